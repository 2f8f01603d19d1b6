"""The distributed checks a one-GPU machine can run (``bash benchmarks/gpu_session.sh
distributed``): data-parallel replicas sharing the GPU give the tokens of one engine, and
what tensor parallelism says on one device (it needs one GPU per rank, so it is refused).

    python -m benchmarks.gpu_distributed
"""

from __future__ import annotations

import tempfile
import time


def main() -> None:
    import torch

    from llmlab import LLM, SamplingParams
    from llmlab.testing.tiny import build_tiny_model

    assert torch.cuda.is_available(), "needs CUDA"
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model(tmp, "Qwen3ForCausalLM", seed=0))
        prompts = [{"prompt_token_ids": list(range(2 + i, 40 + 3 * i))} for i in range(16)]
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        settings = dict(device="cuda", dtype="float32", seed=0, gpu_memory_utilization=0.3)
        one = LLM(path, **settings)
        start = time.perf_counter()
        reference = [o.outputs[0].token_ids for o in one.generate(prompts, params,
                                                                 use_tqdm=False)]
        print(f"1 engine: {time.perf_counter() - start:.2f} s")
        del one
        torch.cuda.empty_cache()
        dp = LLM(path, data_parallel_size=2, router="least_loaded", **settings)
        start = time.perf_counter()
        got = [o.outputs[0].token_ids for o in dp.generate(prompts, params, use_tqdm=False)]
        print(f"2 replicas sharing the GPU: {time.perf_counter() - start:.2f} s, "
              f"same tokens: {got == reference}, health: "
              f"{[s.status for s in dp.llm_engine.health()]}")
        dp.llm_engine.shutdown()
        try:
            LLM(path, tensor_parallel_size=2, **settings)
        except ValueError as err:
            print(f"tensor_parallel_size=2 on {torch.cuda.device_count()} GPU(s): {err}")


if __name__ == "__main__":
    main()
