"""Memory: the VRAM budget's sizes, facts and residency plan (:mod:`.plan`), the stage context the loop enters
(:mod:`.stages`) and the budget's, which opens engines per stage and releases them (:mod:`.residency`), the tiled
VAE decode (:mod:`.vae_tiling`), the per-stage device meter, a hook of the stage context (:mod:`.memory_meter`),
and the host-memory check of a request (:mod:`.host_memory`).

Nothing is imported here: import the module you need (``from diffusion_trt.runtime.memory.plan import
parse_size``).
"""
