"""A model given by its folder is loaded where it runs: the Router's process reads its config and
tokenizer only (`tokenrouter_sdk.deferred`), the sub-server loads it into its own memory (no
memory map) and, owning it, keeps each projection weight once (its packed copy); what it
computes is unchanged."""

import pytest
import torch

from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.backends.torch_runner import TorchRunner, TorchRunnerSpec
from tokenrouter_sdk.deferred import DeferredModel, LazyModels, parameter_count
from tokenrouter_sdk.engine.runner import SeqInput
from tokenrouter_sdk.models import load_model, load_private, tiny_model, tiny_tokenizer
from tokenrouter_sdk.policies import RandomRouting

from ..helpers import assert_matches_reference, mixed_prompts, pools_free


def _save(root, name, *, dtype=torch.float32, layers=2, seed=4, **config):
    m = tiny_model(num_layers=layers, seed=seed, dtype=dtype, max_position_embeddings=1024, **config)
    m.save_pretrained(root / name)
    tiny_tokenizer().save_pretrained(root / name)
    return str(root / name), m


def test_a_folder_model_is_loaded_by_its_subserver_and_here_only_when_asked(tmp_path):
    small, _ = _save(tmp_path, "small", layers=1, seed=3)
    large, large_model = _save(tmp_path, "large", layers=2, seed=4)
    prompts = mixed_prompts(4, seed=2)
    params = SamplingParams(max_new_tokens=10)
    with Router({"small": small, "large": large}, processes=True, max_kv_tokens=2048) as router:
        assert isinstance(router.models, LazyModels)
        assert not router.models.loaded("small") and not router.models.loaded("large")
        info = router.models.info("large")
        assert isinstance(info, DeferredModel) and info.nbytes == sum(p.numel() * 4 for p in large_model.parameters())
        outs = router.generate(prompts, sampling=params, policy=RandomRouting(p=0.5, seed=1), concurrency=4)
        assert not router.models.loaded("large")  # generating loads nothing here
        ref_models = {"small": load_model(small)[0], "large": load_model(large)[0]}
        assert_matches_reference(
            ref_models,
            outs,
            lambda: RandomRouting(p=0.5, seed=1),
            params,
            eos_ids=router.engine.eos_ids,
            tokenizer=router.tokenizer,
        )
        assert sum(o.hops for o in outs) > 0
        here = router.models["large"]  # loaded here at its first access, once
        assert router.models.loaded("large") and router.models["large"] is here
        for (n, p), q in zip(here.named_parameters(), large_model.parameters()):
            assert torch.equal(p, q), n
        assert all(pools_free(router).values())


def test_parameter_count_reads_the_safetensors_headers(tmp_path):
    folder, model = _save(tmp_path, "m")
    assert parameter_count(folder) == sum(p.numel() for p in model.parameters())


def _logits(runner, prompt):
    runner.forward([SeqInput(prompt, 0, [0, 1])])
    return runner.forward([SeqInput([7], len(prompt), [0, 1])]).logits


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", False), ("llama", True)])
def test_a_runner_that_loaded_its_model_keeps_each_projection_weight_once(tmp_path, monkeypatch, arch, tied):
    monkeypatch.setenv("TOKENROUTER_PACKING", "packed")  # both runners on the same GEMM path
    folder, _ = _save(tmp_path, "m", dtype=torch.bfloat16, arch=arch, tie_word_embeddings=tied)
    owned = TorchRunnerSpec(folder, dtype=torch.bfloat16, max_kv_tokens=64, kernels="off").build()
    shared = TorchRunner(load_model(folder, dtype="bfloat16")[0], max_kv_tokens=64, kernels="off")
    try:
        model = owned.model
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        freed = [m for m in linears if m.weight.untyped_storage().nbytes() <= 2]
        head = model.get_output_embeddings()
        assert owned.plain_released == sum(m.weight.numel() * 2 for m in freed) > 0
        if tied:  # the LM head's weight is the input embedding's: kept whole
            assert head not in freed and head.weight.untyped_storage().nbytes() == head.weight.numel() * 2
            assert len(freed) == len(linears) - 1
        else:
            assert len(freed) == len(linears)
        assert shared.plain_released == 0 and all(
            m.weight.untyped_storage().nbytes() > 2 for m in shared.model.modules() if isinstance(m, torch.nn.Linear)
        )
        prompt = list(range(40, 60))
        for _ in range(2):  # the second step reuses what the first built: nothing rebuilt from freed weights
            assert torch.equal(_logits(owned, prompt), _logits(shared, prompt))
    finally:
        owned.release()
        shared.release()


def _mapped(folder) -> bool:
    with open("/proc/self/maps") as f:
        return any(folder in line for line in f)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_load_private_reads_the_weights_into_this_process_without_mapping_the_file(tmp_path):
    folder, model = _save(tmp_path, "m", dtype=torch.bfloat16)
    got = load_private(folder, dtype="bfloat16")
    for (n, p), q in zip(got.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n
    assert not _mapped(folder)
    mapped, _ = load_model(folder, dtype="bfloat16")  # transformers' own load maps the file
    assert _mapped(folder)
    del mapped


def test_kv_pools_are_planned_on_the_memory_left_after_a_deferred_model_loads(tmp_path):
    from tokenrouter_sdk.kv_sizing import kv_bytes_per_token, plan

    folder, model = _save(tmp_path, "m")
    d = DeferredModel(folder, torch.float32, "cpu")
    per = kv_bytes_per_token(d)
    assert per == kv_bytes_per_token(model)
    left = d.nbytes + 1000 * per  # after the load, room for 1,000 tokens at fraction 1
    got = plan({"m": d}, block_size=16, fraction=1.0, probe=lambda dev: left)["m"]
    assert got.tokens == 992 and got.weights_bytes == d.nbytes  # whole blocks of 16 within 1,000 tokens
