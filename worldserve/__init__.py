"""worldserve: a serving engine for NVIDIA Cosmos3 omnimodal world models.

Glossary (used in every module):
- `und` / `gen`: the understanding (text, causal) and generation (diffusion tokens) pathways of the MoT.
- `latents`: (B, C, F, H, W) video latents; `tokens`: packed (N, D) rows.
- `request`, `step` (one denoising step), `plan` (what the engine asks the runner to do), `result`.
"""

__version__ = "0.1.0"
