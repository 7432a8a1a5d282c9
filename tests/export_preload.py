"""What `python -m export` imports, imported once into the test run's export fork server (tests/export_fork.py):
each export forked from it starts with torch, diffusers, transformers and jax loaded (about 10 of a tiny export's 20 s
are those imports). Nothing here starts a thread or a JAX backend, so forking after it is safe."""

import export.__main__

# as `python -m export` does before it imports them: the build libraries read their verbosity when imported
export.__main__._quiet_build_libraries()

import diffusers  # noqa: E402
import torch  # noqa: E402, F401
import transformers  # noqa: E402

import export.attach  # noqa: E402, F401
import export.build  # noqa: E402, F401
import export.source  # noqa: E402, F401
import export.torchax_compat  # noqa: E402, F401  (torchax itself builds its environment on first use: in the export)

# diffusers and transformers import their classes on first use: load the ones the Wan family's exports build
for _name in ("WanPipeline", "WanImageToVideoPipeline", "WanVACEPipeline", "WanAnimatePipeline", "LucyEditPipeline",
              "SkyReelsV2Pipeline", "SkyReelsV2DiffusionForcingPipeline", "AutoencoderKLWan", "WanTransformer3DModel",
              "WanVACETransformer3DModel", "WanAnimateTransformer3DModel", "SkyReelsV2Transformer3DModel",
              "UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler"):
    getattr(diffusers, _name, None)
for _name in ("UMT5EncoderModel", "UMT5Config", "CLIPVisionModel", "CLIPVisionConfig", "CLIPImageProcessor",
              "PreTrainedTokenizerFast", "AutoTokenizer"):
    getattr(transformers, _name, None)

# What the server holds lives as long as it: frozen, each forked export's collections (export/__main__.py freezes
# again what it loads after) skip the libraries' objects, and the children never write to their shared pages for it.
import gc  # noqa: E402

gc.freeze()
