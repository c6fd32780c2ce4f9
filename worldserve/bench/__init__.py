"""`worldserve bench`: GPU benchmark of the denoising step (ours vs diffusers), the decoders and the mux.

Modules: `flops` (performance.md §1 FLOP model, pure Python), `workload` (token and latent shapes of a
request), `timing` (CUDA-event timers, peak memory), `models` (random full-size weights, shared between
our transformer and diffusers' `Cosmos3OmniTransformer`), `denoise` (one CFG step for each), `decode`
(Wan2.2 VAE, audio VAE, MP4 mux), `report` (JSON + markdown under bench/results/) and `runner` (the
phases of one run). Nothing here is imported by the serving path.
"""
