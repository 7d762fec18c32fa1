"""Block-diffusion LLMs: threshold decoding with token editing (``decoding``), masked-diffusion SFT
(``sft``), trajectory-aware self-distillation (``tad``), EBPO RL (``ebpo``, ``ebpo_trainer``), their
metrics and their server backend (``server``)."""
