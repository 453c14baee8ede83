"""The engine-runner tier: models run by vLLM's runner (and SGLang's where it installs), behind our
runner seam. Skipped, with the reason, where the engine is not installed
(``pip install 'tokenrouter-sdk[vllm]'``).

The tiny models are random-weight Llama and Qwen2 checkpoints written here (``config.json`` and
float32 safetensors, head dim 32: vLLM's CPU attention takes head sizes from 32), loaded by the
engine from their folders; the naive reference (`tokenrouter_sdk.reference`) runs the same folders
loaded by transformers."""

import pytest
import torch

from tokenrouter_sdk.models import tiny_model, tiny_tokenizer

ARCHS = ("llama", "qwen2")


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory):
    """arch -> {"small": folder, "large": folder}: a 4-layer large model and its first 2 layers,
    float32, with the tiny tokenizer."""
    root = tmp_path_factory.mktemp("engine-models")
    out = {}
    for i, arch in enumerate(ARCHS):
        large = tiny_model(
            arch=arch,
            num_layers=4,
            hidden_size=128,
            num_heads=4,
            num_kv_heads=2,
            seed=20 + i,
            dtype=torch.float32,
            max_position_embeddings=1024,
        )
        small = tiny_model(
            arch=arch,
            num_layers=2,
            hidden_size=128,
            num_heads=4,
            num_kv_heads=2,
            seed=20 + i,
            dtype=torch.float32,
            max_position_embeddings=1024,
        )
        out[arch] = {}
        for name, m in (("small", small), ("large", large)):
            folder = root / arch / name
            m.save_pretrained(folder)
            tiny_tokenizer().save_pretrained(folder)
            out[arch][name] = str(folder)
    return out


@pytest.fixture(scope="session")
def reference_models(tiny_folders):
    """arch -> {"small", "large"}: the folders loaded by transformers in float32 (the reference's
    models, never given to a Router)."""
    from transformers import AutoModelForCausalLM

    return {
        arch: {
            n: AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval().requires_grad_(False)
            for n, f in pair.items()
        }
        for arch, pair in tiny_folders.items()
    }
