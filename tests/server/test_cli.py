"""``llmlab generate`` works offline on a fresh cache, with and without ``--model``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from llmlab.server.cli import main
from tests.helpers import CLI_KV_FLAGS


def run_cli(args, cache_dir):
    exe = shutil.which("llmlab")
    cmd = [exe] if exe else [sys.executable, "-m", "llmlab"]
    env = dict(os.environ, LLMLAB_CACHE=str(cache_dir), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if args[0] == "generate":
        args = [*args, *CLI_KV_FLAGS]
    return subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=300)


def test_generate_without_model_tells_a_story_with_the_builtin_model(tmp_path):
    from llmlab.models.builtin.stories import vocabulary, words

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
