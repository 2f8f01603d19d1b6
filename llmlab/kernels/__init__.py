"""llmlab's compute kernels, in one place: what the attention backends and the models call.

* :mod:`~llmlab.kernels.cpu_kernels`: finds, builds and loads the C++ CPU kernels
  (``csrc/cpu_kernels.cpp``: paged attention, the fused elementwise ops, greedy argmax);
  standard library only.
* :mod:`~llmlab.kernels.fused`: the fused CPU elementwise ops (residual + RMSNorm, SiLU x up,
  rotary), each with its plain-torch equivalent.
* :mod:`~llmlab.kernels.cpu_linear`: oneDNN-prepacked linear layers for CPU.
* :mod:`~llmlab.kernels.triton_kernels`: the Triton kernels (KV write, paged attention,
  split reduction).

Nothing is imported here (triton is optional, and ``setup.py`` loads the C++ loader by path),
and nothing here imports :mod:`llmlab.attention` or :mod:`llmlab.models`: they import it.
"""
