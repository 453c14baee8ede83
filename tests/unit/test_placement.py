"""Per-model placement and precision: sources saved to folders (tiny models, no hub) load with
their own device and dtype (``ModelSpec``, a dict, Router-wide defaults), ``dtype="auto"`` takes
the folder's config, dtype names are accepted; devices that cannot be used, settings that cannot
apply and an unreachable hub raise errors that name the fix."""

import time

import pytest
import torch

from tokenrouter_sdk import Router
from tokenrouter_sdk.models import ModelLoadError, load_model, tiny_model, tiny_tokenizer
from tokenrouter_sdk.placement import DeviceError, ModelSpec, cuda_install_command, resolve_device, resolve_dtype
from tokenrouter_sdk.policies import RandomRouting


def save(folder, dtype, layers, seed):
    model = tiny_model(num_layers=layers, seed=seed, dtype=dtype)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A float32 small and a float64 large model, each saved with its dtype in config.json."""
    root = tmp_path_factory.mktemp("models")
    return save(root / "small", torch.float32, 1, 3), save(root / "large", torch.float64, 2, 4)


def runner_dtypes(router):
    return {n: (r.dtype, r.device.type) for n, r in router.engine.runners.items()}


def test_auto_dtype_is_each_folders_own(folders):
    small, large = folders
    with Router({"small": small, "large": str(large)}, RandomRouting(p=0.5, seed=1)) as r:
        assert runner_dtypes(r) == {"small": (torch.float32, "cpu"), "large": (torch.float64, "cpu")}
        outs = r.generate(["ab", "cd"], max_new_tokens=6, ignore_eos=True)
        assert all(o.ok and len(o.token_ids) == 6 for o in outs) and {"small", "large"} <= {
            m for o in outs for m in o.token_models
        }


def test_per_model_specs_and_dicts_win_over_router_defaults(folders):
    small, large = folders
    models = {
        "small": ModelSpec(small, device="cpu", dtype="bfloat16"),
        "large": {"source": large, "dtype": torch.float32},
    }
    with Router(models, dtype="float64", device="cpu") as r:
        assert runner_dtypes(r) == {"small": (torch.bfloat16, "cpu"), "large": (torch.float32, "cpu")}
    with Router({"small": small, "large": large}, dtype={"small": "float64"}) as r:  # per model, the rest auto
        assert runner_dtypes(r) == {"small": (torch.float64, "cpu"), "large": (torch.float64, "cpu")}
    with pytest.raises(TypeError, match="'source'"):
        Router({"small": {"path": small}, "large": large})
    with pytest.raises(ValueError, match="names model"):
        Router({"small": small, "large": large}, dtype={"huge": "float32"})


def test_dtype_names():
    assert resolve_dtype("bfloat16") is torch.bfloat16 and resolve_dtype("BF16") is torch.bfloat16
    assert resolve_dtype("torch.float16") is torch.float16 and resolve_dtype("auto") == "auto"
    assert resolve_dtype(torch.float64) is torch.float64 and resolve_dtype(None) is None
    for bad in ("int8", "float8", torch.int64, 3):
        with pytest.raises(ValueError, match="bfloat16"):
            resolve_dtype(bad)


def test_load_model_dtype_string_and_auto(folders):
    small, large = folders
    assert load_model(large)[0].dtype == torch.float64  # auto: the config's
    assert load_model(large, dtype="float32")[0].dtype == torch.float32  # a string, not a TypeError


def test_cuda_on_a_cpu_only_torch_names_the_install_command(monkeypatch, folders):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    with pytest.raises(DeviceError) as err:
        resolve_device("cuda:0")
    assert "CPU-only build" in str(err.value) and cuda_install_command() in str(err.value)
    assert "--index-url https://download.pytorch.org/whl/cu" in cuda_install_command()
    t0 = time.perf_counter()
    with pytest.raises(DeviceError, match="CPU-only"):  # checked before anything loads
        Router({"small": ModelSpec(folders[0], device="cuda:0"), "large": folders[1]})
    with pytest.raises(DeviceError, match="CPU-only"):
        Router.default(device="cuda")  # no longer keeps the CPU in silence
    assert time.perf_counter() - t0 < 5


def test_a_device_index_that_does_not_exist(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(
        DeviceError, match=r"'cuda:3' does not exist: this machine has 2 CUDA devices \(cuda:0, cuda:1\)"
    ):
        resolve_device("cuda:3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="sees no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(DeviceError, match="not a device name"):
        resolve_device("gpu0")


def test_settings_that_cannot_apply_raise(pair, tok):
    with pytest.raises(ValueError, match="loaded model on cpu"):
        Router(pair, tokenizer=tok, device="meta")  # a loaded model is not moved in silence
    with pytest.raises(ValueError, match="loaded in torch.float64"):
        Router(pair, tokenizer=tok, dtype="float32")
    with Router(pair, tokenizer=tok, dtype="float64", device="cpu") as r:  # what they are: fine
        assert runner_dtypes(r)["large"] == (torch.float64, "cpu")
    with pytest.raises(ValueError, match="backend='sim'"):
        Router({"small": None, "large": None}, backend="sim", device="cpu")
    with pytest.raises(ValueError, match="mode='delayed'"):
        Router(pair, tokenizer=tok, mode="async", thresholds={"small": 2})
    with pytest.raises(ValueError, match="not both"):
        Router(pair, tokenizer=tok, max_kv_tokens=256, kv_memory_fraction=0.5)
    with pytest.raises(ValueError, match="not both"):
        Router.default(small_layers=4, draft="x.safetensors")
    with pytest.raises(ValueError, match="one device"):
        Router.default(device={"small": "cpu", "large": "cpu"})


def test_unreachable_hub_fails_fast_with_the_offline_hint(monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hc, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError) as err:
        load_model("Qwen/Qwen3-0.6B")
    assert time.perf_counter() - t0 < 5  # no retries
    assert "HF_HUB_OFFLINE=1" in str(err.value) and "local folder" in str(err.value)
