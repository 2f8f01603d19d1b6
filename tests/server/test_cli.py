"""``llmlab generate`` works offline on a fresh cache, with and without ``--model``."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from llmlab.entrypoints.cli import main
from tests.helpers import CLI_KV_FLAGS, subprocess_env


def run_cli(args, cache_dir):
    exe = shutil.which("llmlab")
    cmd = [exe] if exe else [sys.executable, "-m", "llmlab"]
    env = subprocess_env(LLMLAB_CACHE=str(cache_dir), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if args[0] == "generate":
        args = [*args, *CLI_KV_FLAGS]
    return subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow  # two fresh `llmlab generate` processes: about 30 s on 2 cores
def test_generate_without_model_tells_a_story_with_the_builtin_model(tmp_path):
    from llmlab.builtin.stories import vocabulary, words

    result = run_cli(["generate", "Once upon a time", "--max-tokens", "40"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "built-in story model" in result.stderr
    assert "Prompt: 'Once upon a time'" in result.stdout
    completion = result.stdout.split("Completion: ", 1)[1]
    generated = words(completion.rsplit("(finish_reason", 1)[0])
    assert len(generated) >= 10
    known = vocabulary()
    assert sum(w in known for w in generated) / len(generated) >= 0.9, completion
    assert not any(tmp_path.iterdir()), "the built-in model ships with llmlab: nothing to cache"
    # Greedy decoding is deterministic.
    again = run_cli(["generate", "Once upon a time", "--max-tokens", "40"], tmp_path)
    assert again.returncode == 0 and again.stdout == result.stdout


def test_generate_with_a_local_model_and_sampling_flags(tiny_llama, tmp_path):
    result = run_cli(
        ["generate", "One", "Two", "--model", tiny_llama, "--max-tokens", "5",
         "--temperature", "0.8", "--top-p", "0.9", "--sampling-seed", "3"],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("Completion:") == 2


def test_generate_reports_bad_values_clearly(tiny_llama, tmp_path):
    result = run_cli(["generate", "x", "--model", tiny_llama, "--top-p", "2"], tmp_path)
    assert result.returncode == 2
    assert "top_p must be in (0, 1], got 2.0" in result.stderr


def test_flag_prefixes_are_not_guessed(tiny_llama, tmp_path):
    result = run_cli(["generate", "x", "--model", tiny_llama, "--max-tok", "3"], tmp_path)
    assert result.returncode == 2
    assert "unrecognized arguments: --max-tok" in result.stderr


def test_a_bad_model_path_is_one_error_line(tmp_path):
    result = run_cli(["generate", "x", "--model", str(tmp_path / "missing")], tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "missing" in lines[0]
    assert "Traceback" not in result.stderr


def test_components_lists_every_registered_name_with_its_summary(capsys):
    from llmlab import registry

    assert main(["components"]) == 0
    out = capsys.readouterr().out
    for kind in registry.KINDS:
        assert f"{kind}:" in out
        for name in registry.available(kind):
            assert f"  {name} " in out
    assert "Virtual Token Counter" in out
    assert main(["components", "eviction_policy"]) == 0
    assert "scheduling_policy" not in capsys.readouterr().out
    assert main(["components", "nope"]) == 2
    assert "unknown component kind 'nope'" in capsys.readouterr().err


def test_a_policy_can_be_named_by_import_path(tiny_llama, capsys):
    rc = main(["generate", "Hi", "--model", tiny_llama, "--max-tokens", "2",
               "--scheduling-policy", "llmlab.scheduler.policies:ShortestPromptFirst"])
    assert rc == 0 and "Completion:" in capsys.readouterr().out
    rc = main(["generate", "Hi", "--model", tiny_llama, "--scheduling-policy", "no.such:Thing"])
    assert rc == 2 and "cannot import 'no.such'" in capsys.readouterr().err


def test_generate_with_n_stop_and_logprobs(tiny_llama, capsys):
    code = main(["generate", "Hi", "--model", tiny_llama, "--max-tokens", "6", "--n", "2",
                 "--temperature", "0.9", "--sampling-seed", "1", "--logprobs", "2",
                 "--stop", "zz", "--presence-penalty", "0.5"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Completion 0:" in out and "Completion 1:" in out
    assert "(rank 1)" in out  # the top-2 lines
    assert main(["generate", "Hi", "--model", tiny_llama, "--n", "2", "--best-of", "1"]) == 2
    assert "best_of must be >= n (2), got 1" in capsys.readouterr().err


POLICY_MODULE = '''
from llmlab import Policy


class MySPF(Policy):
    name = "my_spf"

    def key(self, request):
        return request.num_prompt_tokens
'''


def test_a_policy_import_path_resolves_from_the_current_directory(tmp_path, monkeypatch):
    """``--scheduling-policy mypkg.policies:MySPF`` with ``mypkg/`` in the working directory,
    as docs/components.md shows it: found as ``python -m`` would find it, also when the
    ``llmlab`` console script runs (whose ``sys.path`` starts at its own folder)."""
    from llmlab import registry

    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "policies.py").write_text(POLICY_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "mypkg", raising=False)
    monkeypatch.delitem(sys.modules, "mypkg.policies", raising=False)
    assert registry.resolve("scheduling_policy", "mypkg.policies:MySPF").__name__ == "MySPF"
    assert sys.path[-1] == str(tmp_path)  # appended: installed packages keep priority
    with pytest.raises(ValueError, match="cannot import 'nopkg.policies'"):
        registry.resolve("scheduling_policy", "nopkg.policies:X")


def test_the_console_script_takes_a_policy_from_the_current_directory(tiny_llama, tmp_path):
    exe = shutil.which("llmlab")
    if exe is None:
        pytest.skip("the llmlab console script is not installed (pip install -e .)")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "policies.py").write_text(POLICY_MODULE)
    result = subprocess.run(
        [exe, "generate", "One", "--model", tiny_llama, "--max-tokens", "3",
         "--scheduling-policy", "mypkg.policies:MySPF", *CLI_KV_FLAGS],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=subprocess_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"),
    )
    assert result.returncode == 0, result.stderr
    assert "Completion:" in result.stdout


def test_generate_with_speculative_config_prints_the_same_greedy_text(capsys):
    from llmlab.builtin import builtin_model_path

    prompt = ("Once upon a time, there was a shy boy named Lucky who lived in a little house. "
              "Once upon a time")
    args = ["generate", prompt, "--model", str(builtin_model_path()), "--max-tokens", "24",
            *CLI_KV_FLAGS]
    assert main(args) == 0
    plain = capsys.readouterr().out
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert main([*args, "--speculative-config", spec]) == 0
    assert capsys.readouterr().out == plain
    assert "Completion: " in plain


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("config, message", [
    ("{bad", "speculative_config is not valid JSON"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "'eagle' needs a trained draft head"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "'num_speculative_tokens' must be"),
])
def test_a_bad_speculative_config_is_one_error_line_and_exit_2(capsys, command, config,
                                                                message):
    from llmlab.builtin import builtin_model_path

    args = [command, *(["x"] if command == "generate" else []),
            "--model", str(builtin_model_path()), "--speculative-config", config]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_replica_deadline_flags_reach_the_engine_settings():
    """--replica-heartbeat-timeout-s / --replica-wedged-after-s (issue 39, item 7) become
    build_engine keywords; left out, the defaults apply (no keyword at all)."""
    from llmlab.entrypoints.cli import _engine_settings, build_parser

    args = build_parser().parse_args(["serve", "--replica-heartbeat-timeout-s", "2.5",
                                      "--replica-wedged-after-s", "30"])
    settings = _engine_settings(args)
    assert settings["replica_heartbeat_timeout_s"] == 2.5
    assert settings["replica_wedged_after_s"] == 30
    plain = _engine_settings(build_parser().parse_args(["serve"]))
    assert "replica_heartbeat_timeout_s" not in plain and "replica_wedged_after_s" not in plain
