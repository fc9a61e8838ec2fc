"""Start-up checks of the attention kernel a run asks for, before the model is built.

transformers accepts `--attn_implementation flash_attention_2` without the flash-attn package (on a
CUDA machine it then fetches a kernel from the Hub, which fails late on an offline cluster) and
without a CUDA GPU, and under fp32 the kernel fails at the first forward (it takes fp16 and bf16
only). Each is one line here instead.
"""

from __future__ import annotations

from common.config import ConfigError

FLASH = {"flash_attention_2": ("flash-attn", "is_flash_attn_2_available"),
         "flash_attention_3": ("flash-attn-3", "is_flash_attn_3_available")}


def check_flash(attention: str, accelerator) -> None:
    if attention not in FLASH:
        return
    import transformers.utils

    package, available = FLASH[attention]
    if not getattr(transformers.utils, available)():  # the package, its version and a CUDA GPU
        raise ConfigError(f"--attn_implementation {attention} needs a CUDA GPU and the {package} package "
                          f"installed (pip install {package}); use sdpa (the default) otherwise")
    if accelerator.mixed_precision == "no":
        raise ConfigError(f"--attn_implementation {attention} runs in bf16 or fp16, and this launch's mixed "
                          "precision is 'no' (fp32): launch with --mixed_precision bf16, or use sdpa")
