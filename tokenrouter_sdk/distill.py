"""Distil a self-draft small model from a large model on this CPU (``tokenrouter distill``).

Pipeline (each step a function, usable from a notebook; `distill` runs them all):

1. `synthetic_prompts`: templated prompts made in code (grade-school word problems with random
   names and numbers, and general instructions over a topic list). No text of the benchmark
   sets (`tokenrouter_sdk.benchmarks`) is used, so nothing overlaps them.
2. `teacher_continuations`: the large model's own continuations (greedy for half of the
   prompts, temperature 0.7 for the rest) through this package's engine (sequence-level
   knowledge distillation, Kim & Rush 2016, arXiv 1606.07947, section 3.2).
3. `teacher_targets`: one full-model forward per sequence gives the residual stream after layer
   ``k`` (the draft's frozen input, cached once, so training never reruns the shared layers) and
   the teacher's top-``topk`` next-token log-probabilities.
4. `train_draft`: the ``m`` trained layers (initialised from the large model's last ``m``
   layers) and the final norm minimise the cross-entropy to the teacher's renormalised top-``topk``
   distribution (word-level KD, Hinton et al. 2015) on every position after the system prompt.
   AdamW, cosine schedule, bf16 autocast, a wall-clock budget in seconds.
5. `agreement`: teacher-forced greedy agreement along the large model's greedy continuations of
   held-out prompts: the fraction of positions where ``argmax`` of the draft equals the large
   model's greedy token.

The packaged draft (``tokenrouter_sdk/assets/smollm2_self_draft.safetensors``) was made by
``tokenrouter distill`` with the defaults below; its sidecar JSON records the data sizes, the
time taken and the measured agreement.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from .benchmarks import get_spec
from .benchmarks import load as load_benchmark_rows
from .self_draft import attach_layers, init_trainable, save_self_draft

NAMES = ["Ava", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Liam",
         "Mara", "Nikhil", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wen", "Yusuf"]
ITEMS = [("apples", "basket"), ("pencils", "box"), ("stickers", "sheet"), ("cookies", "tray"),
         ("marbles", "bag"), ("books", "shelf"), ("eggs", "carton"), ("bottles", "crate"),
         ("cards", "pack"), ("flowers", "vase"), ("shirts", "drawer"), ("tiles", "row")]
JOBS = ["washing cars", "walking dogs", "babysitting", "tutoring", "mowing lawns", "selling lemonade"]
MATH_TEMPLATES = [
    "{a} has {x} {i}. {b} gives {a} {y} more {i}. How many {i} does {a} have now?",
    "{a} buys {x} {c}s of {i}. Each {c} holds {y} {i}. How many {i} does {a} buy in total?",
    "A {c} holds {y} {i}. {a} has {z} {i} to pack. How many full {c}s can {a} fill, and how many {i} are left?",
    "{a} earns ${x} per hour {j}. Last week {a} worked {y} hours and spent ${z} on lunch. How much money is left?",
    "{a} reads {x} pages a day. The book has {w} pages. How many days does it take to finish the book?",
    "{a} had ${w}. {a} spent {p}% of it on {i} and ${y} on a ticket. How much money does {a} have left?",
    "There are {x} students in a class. {p}% of them play soccer and {y} of the rest play chess. "
    "How many students play chess?",
    "{a} is {x} years old. {b} is {y} years older than twice {a}'s age. How old is {b}?",
    "A train travels {x} miles per hour for {y} hours, then {z} miles per hour for {u} hours. "
    "How far does it travel in total?",
    "{a} and {b} share {w} {i} in the ratio {u}:{v}. How many {i} does {b} get?",
    "A rectangle is {x} meters long and {y} meters wide. What is its area and its perimeter?",
    "{a} saves ${x} every week. How many weeks does {a} need to save ${w}?",
    "A shop sells {i} at ${u} each or {v} for ${x}. How much does {a} save buying {v} at once?",
    "{a} runs {u} kilometers on Monday, {v} on Tuesday and twice as much on Wednesday as on Monday. "
    "How many kilometers does {a} run in the three days?",
    "A recipe needs {u} cups of flour for {v} {i}. How many cups are needed for {x} {i}?",
    "{a} bought {x} {i} for ${y} each and sold them for ${z} each. What was the profit?",
]
TOPICS = ["photosynthesis", "the water cycle", "gravity", "volcanoes", "the moon", "electricity",
          "the human heart", "recycling", "the internet", "honey bees", "rainbows", "earthquakes",
          "the Roman Empire", "democracy", "compound interest", "fractions", "prime numbers",
          "healthy sleep", "learning a new language", "climate", "ocean tides", "the solar system",
          "vaccines", "bread baking", "chess", "the piano", "bicycles", "friendship", "saving money",
          "time management", "deserts", "rain forests", "penguins", "elephants", "coffee", "tea",
          "the printing press", "airplanes", "batteries", "magnets", "the seasons", "clouds",
          "sound waves", "light", "computers", "robots", "gardening", "mountains", "rivers", "maps"]
GENERAL_TEMPLATES = [
    "Explain {t} in simple terms.", "Give three interesting facts about {t}.",
    "Write a short paragraph about {t}.", "Why is {t} important?", "What are the main ideas behind {t}?",
    "Describe {t} to a ten-year-old.", "Write a short story that involves {t}.",
    "What are common misconceptions about {t}?", "How would you teach someone about {t}?",
    "Summarize the history of {t} in a few sentences.",
]
# The instruction before each synthetic word problem (part of the recipe of the packaged draft;
# benchmark questions use their own template from `tokenrouter_sdk.benchmarks`).
MATH_INSTRUCTION = "Solve the problem. Give the final answer as a number at the end.\n\n"


def synthetic_prompts(n: int, seed: int = 0, math_fraction: float = 0.6) -> list[str]:
    """``n`` distinct prompts made from templates (``math_fraction`` word problems prefixed with
    `MATH_INSTRUCTION`, the rest general instructions). Deterministic in ``seed``."""
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < n:
        if rng.random() < math_fraction:
            a, b = rng.sample(NAMES, 2)
            i, c = rng.choice(ITEMS)
            vals = dict(a=a, b=b, i=i, c=c, j=rng.choice(JOBS), x=rng.randint(2, 60), y=rng.randint(2, 30),
                        z=rng.randint(2, 90), u=rng.randint(2, 9), v=rng.randint(2, 9),
                        w=rng.choice([60, 84, 96, 120, 150, 180, 240, 300, 360, 420, 500]),
                        p=rng.choice([10, 20, 25, 30, 40, 50, 60, 75]))
            p = MATH_INSTRUCTION + rng.choice(MATH_TEMPLATES).format(**vals)
        else:
            p = rng.choice(GENERAL_TEMPLATES).format(t=rng.choice(TOPICS))
            if p in seen:
                continue
        seen.add(p)
        out.append(p)
    return out


def teacher_continuations(large, tok, prompts: list[str], max_new_tokens: int = 160, *,
                          greedy_fraction: float = 0.5, temperature: float = 0.7, seed: int = 0,
                          concurrency: int = 32, progress: bool = True) -> list[list[int]]:
    """Full token sequences (chat-templated prompt + the large model's continuation) for each
    prompt, generated with this package's engine (one sub-server, in-process)."""
    from tokenrouter_sdk.policies import SingleModel
    from tokenrouter_sdk.request import SamplingParams

    from .router import Router

    n_greedy = int(round(greedy_fraction * len(prompts)))
    sampling = [SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0 if i < n_greedy else temperature,
                               seed=seed + i) for i in range(len(prompts))]
    with Router({"large": large}, SingleModel("large"), tokenizer=tok, processes=False,
                max_kv_tokens=concurrency * (max_new_tokens + 256)) as r:
        outs = r.generate(prompts, sampling=sampling, concurrency=concurrency, progress=progress)
        return [r.encode(p) + list(o.token_ids) for p, o in zip(prompts, outs)]


def system_prefix_len(tok) -> int:
    """Tokens of the chat template before the user's text (the same for every prompt: no loss there)."""
    a = tok.apply_chat_template([{"role": "user", "content": "A"}], add_generation_prompt=True, tokenize=True)
    b = tok.apply_chat_template([{"role": "user", "content": "B"}], add_generation_prompt=True, tokenize=True)
    a, b = (x["input_ids"] if hasattr(x, "keys") else x for x in (a, b))
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


@dataclass
class TeacherData:
    """Cached training tensors, one entry per sequence of length T_s.

    Attributes:
        hidden: residual stream after layer ``k`` (input of the trained layers), [T_s, H] float32.
        top_ids: the teacher's top-``topk`` next-token ids at each position, [T_s, topk] int64.
        top_logp: their log-probabilities (not renormalised), [T_s, topk] float32.
        start: first position whose next-token prediction is trained (after the system prompt).
    """

    k: int
    hidden: list[torch.Tensor] = field(default_factory=list)
    top_ids: list[torch.Tensor] = field(default_factory=list)
    top_logp: list[torch.Tensor] = field(default_factory=list)
    start: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Trained positions in all (tokens)."""
        return sum(h.shape[0] - 1 - s for h, s in zip(self.hidden, self.start))


@torch.no_grad()
def teacher_targets(large, seqs: list[list[int]], k: int, *, topk: int = 32, start: int = 0,
                    progress: bool = True) -> TeacherData:
    """One forward of ``large`` per sequence: its residual after layer ``k`` and top-``topk``
    next-token log-probabilities at every position (see `TeacherData`)."""
    from tqdm.auto import tqdm

    data = TeacherData(k=k)
    for ids in tqdm(seqs, desc="teacher targets", disable=not progress):
        x = torch.tensor([ids], device=large.device)
        out = large(input_ids=x, output_hidden_states=True, use_cache=False)
        logp = out.logits[0].float().log_softmax(-1)
        v, i = logp.topk(topk, dim=-1)
        data.hidden.append(out.hidden_states[k][0].float().cpu())
        data.top_ids.append(i.cpu())
        data.top_logp.append(v.cpu())
        data.start.append(min(start, len(ids) - 2))
    return data


def draft_hidden(extra, norm, rotary, h: torch.Tensor) -> torch.Tensor:
    """h [B, T, H] (residual after layer k, positions 0..T-1) -> normed last hidden [B, T, H]
    through the trained layers (causal attention, no padding mask: pad on the right)."""
    B, T, _ = h.shape
    pos = torch.arange(T, device=h.device).unsqueeze(0).expand(B, T)
    pe = rotary(h, pos)
    for layer in extra:
        h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        if isinstance(h, tuple):
            h = h[0]
    return norm(h)


def train_draft(large, data: TeacherData, m: int = 2, *, seconds: float = 1200.0, max_epochs: int = 20,
                lr: float = 3e-4, batch_tokens: int = 2048, seed: int = 0, progress: bool = True,
                log=None) -> tuple[list, torch.nn.Module, dict]:
    """Train ``m`` decoder layers + final norm on ``data`` for at most ``seconds`` (wall clock) or
    ``max_epochs``. Returns ``(extra_layers, norm, stats)``; stats holds ``steps``, ``epochs``,
    ``seconds``, ``loss_first``/``loss_last`` (mean soft cross-entropy, nats/token)."""
    from tqdm.auto import tqdm

    extra, norm = init_trainable(large, m)
    params = [p for mod in [*extra, norm] for p in mod.parameters()]
    for mod in extra:
        mod.train()
    rotary, lm_head = large.model.rotary_emb, large.lm_head
    amp = lm_head.weight.dtype == torch.float32  # bf16 autocast for fp32 models (2x faster on AVX512-BF16 CPUs)
    rng = random.Random(seed)
    order = list(range(len(data.hidden)))
    # batches of sequences up to batch_tokens (padded to the longest; right padding is harmless
    # under causal attention, and padded positions carry no loss)
    def batches():
        rng.shuffle(order)
        cur, longest = [], 0
        for i in sorted(order, key=lambda j: (data.hidden[j].shape[0] // 32, rng.random())):
            t = data.hidden[i].shape[0]
            if cur and max(longest, t) * (len(cur) + 1) > batch_tokens:
                yield cur
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, t)
        if cur:
            yield cur
    steps_per_epoch = sum(1 for _ in batches())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    est_steps = max_epochs * steps_per_epoch
    t0, step, losses, first, epoch = time.perf_counter(), 0, [], None, 0

    def lr_factor(s: int) -> float:  # warm-up, then cosine over whichever budget (steps, seconds) ends first
        frac = max(s / max(1, est_steps), (time.perf_counter() - t0) / seconds)
        return min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    bar = tqdm(total=est_steps, desc="distil", disable=not progress)
    done = False
    while epoch < max_epochs and not done:
        batch_list = list(batches())
        rng.shuffle(batch_list)
        for b in batch_list:
            T = max(data.hidden[i].shape[0] for i in b)
            H = data.hidden[b[0]].shape[1]
            h = torch.zeros(len(b), T, H)
            mask = torch.zeros(len(b), T, dtype=torch.bool)
            tid = torch.zeros(len(b), T, data.top_ids[b[0]].shape[1], dtype=torch.long)
            tlp = torch.full((len(b), T, data.top_ids[b[0]].shape[1]), -1e4)
            for r, i in enumerate(b):
                t = data.hidden[i].shape[0]
                h[r, :t], tid[r, :t], tlp[r, :t] = data.hidden[i], data.top_ids[i], data.top_logp[i]
                mask[r, data.start[i]:t - 1] = True
            with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=amp):
                x = draft_hidden(extra, norm, rotary, h)[mask]
                logits = lm_head(x if amp else x.to(lm_head.weight.dtype)).float()
            logp = logits.log_softmax(-1)
            target = tlp[mask].softmax(-1)  # renormalised teacher top-k
            loss = -(target * logp.gather(-1, tid[mask])).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            losses.append(loss.item())
            first = first if first is not None else losses[-1]
            bar.update(1)
            if step % 20 == 0:
                bar.set_postfix(loss=f"{statistics.fmean(losses[-20:]):.3f}")
                if log:
                    log(f"step {step} epoch {epoch} loss {statistics.fmean(losses[-20:]):.4f} "
                        f"{time.perf_counter() - t0:.0f}s")
            if time.perf_counter() - t0 > seconds:
                done = True
                break
        epoch += 1
    bar.close()
    for mod in [*extra, norm]:
        mod.eval().requires_grad_(False)
    stats = {"steps": step, "epochs": epoch, "steps_per_epoch": steps_per_epoch,
             "seconds": round(time.perf_counter() - t0, 1), "loss_first": first,
             "loss_last": statistics.fmean(losses[-20:]) if losses else None}
    return extra, norm, stats


@torch.no_grad()
def agreement(model, seqs: list[list[int]], prompt_lens: list[int]) -> dict:
    """Teacher-forced greedy agreement of ``model`` along sequences whose tokens after
    ``prompt_lens[i]`` are the large model's greedy continuation.

    Returns ``{"agreement": fraction of continuation positions where argmax(model) equals the next
    token, "first_token": the same at the first answer token only, "positions": count}``."""
    hit = n = first_hit = 0
    for ids, p in zip(seqs, prompt_lens):
        if len(ids) <= p:
            continue
        logits = model(input_ids=torch.tensor([ids], device=model.device), use_cache=False).logits[0]
        pred = logits[p - 1:len(ids) - 1].argmax(-1).cpu()
        gold = torch.tensor(ids[p:])
        hit += int((pred == gold).sum())
        n += len(gold)
        first_hit += int(pred[0] == gold[0])
    return {"agreement": hit / max(1, n), "first_token": first_hit / max(1, len(seqs)), "positions": n}


@torch.no_grad()
def step_time_ratio(small, large, batch_sizes=(1, 8), prompt_tokens: int = 128, steps: int = 12) -> dict:
    """Median decode-step seconds of each model (HF KV cache, after a ``prompt_tokens`` prefill) at
    each batch size, and the ratio small/large (lower is faster)."""
    from transformers import DynamicCache

    out = {}
    for B in batch_sizes:
        row = {}
        for name, mdl in (("small", small), ("large", large)):
            vocab = mdl.get_input_embeddings().weight.shape[0]
            ids = torch.randint(0, min(10000, vocab), (B, prompt_tokens), generator=torch.Generator().manual_seed(0))
            cache = DynamicCache()
            o = mdl(input_ids=ids.to(mdl.device), cache=cache, use_cache=True, logits_to_keep=1)
            nxt = o.logits[:, -1].argmax(-1, keepdim=True)
            times = []
            for s in range(steps):
                t0 = time.perf_counter()
                o = mdl(input_ids=nxt, cache=cache, use_cache=True)
                nxt = o.logits[:, -1].argmax(-1, keepdim=True)
                times.append(time.perf_counter() - t0)
            row[name] = statistics.median(times[2:])
        row["ratio"] = row["small"] / row["large"]
        out[f"B={B}"] = row
    return out


@dataclass
class DistillConfig:
    """Settings of `distill` (the defaults made the packaged draft)."""

    k: int = 12
    m: int = 2
    train_prompts: int = 400
    max_new_tokens: int = 128
    heldout_prompts: int = 32
    gsm8k_heldout: int = 32
    topk: int = 32
    seconds: float = 1500.0
    max_epochs: int = 14
    lr: float = 5e-4
    batch_tokens: int = 2048
    seed: int = 0


def distill(large, tok, out, config: DistillConfig | None = None, *, gsm8k_questions: list[str] | None = None,
            progress: bool = True, log=print) -> dict:
    """Run the whole pipeline (module docstring) and write the draft to ``out``. Returns the
    metadata written next to it (config, data sizes, stats, agreements, step-time ratio).

    ``gsm8k_questions``: optional held-out evaluation questions (e.g. the first GSM8K test
    questions), put in the GSM8K template of `tokenrouter_sdk.benchmarks`; they are only ever
    used for the agreement measurement.
    """
    import platform

    cfg = config or DistillConfig()
    t_all = time.perf_counter()
    times = {}
    t = time.perf_counter()
    prompts = synthetic_prompts(cfg.train_prompts + cfg.heldout_prompts, seed=cfg.seed)
    train_p, held_p = prompts[:cfg.train_prompts], prompts[cfg.train_prompts:]
    eval_sets = {"synthetic_heldout": held_p}
    if gsm8k_questions:
        gsm8k = get_spec("gsm8k")
        eval_sets["gsm8k_heldout"] = [gsm8k.prompt(q) for q in gsm8k_questions[:cfg.gsm8k_heldout]]
    log(f"distill: generating teacher continuations for {len(train_p)} training prompts")
    seqs = teacher_continuations(large, tok, train_p, cfg.max_new_tokens, seed=cfg.seed, progress=progress)
    eval_seqs = {}
    for name, ps in eval_sets.items():
        full = teacher_continuations(large, tok, ps, cfg.max_new_tokens, greedy_fraction=1.0, progress=progress)
        eval_seqs[name] = (full, [len(_enc(tok, p)) for p in ps])
    times["generate_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    start = system_prefix_len(tok)
    data = teacher_targets(large, seqs, cfg.k, topk=cfg.topk, start=start, progress=progress)
    times["teacher_targets_s"] = round(time.perf_counter() - t, 1)
    log(f"distill: {data.tokens} training positions from {len(seqs)} sequences; training for at most "
        f"{cfg.seconds:.0f} s")
    extra, norm, stats = train_draft(large, data, cfg.m, seconds=cfg.seconds, max_epochs=cfg.max_epochs,
                                     lr=cfg.lr, batch_tokens=cfg.batch_tokens, seed=cfg.seed,
                                     progress=progress, log=log)
    times["train_s"] = stats["seconds"]
    p = next(large.parameters())
    for mod in [*extra, norm]:
        mod.to(device=p.device, dtype=p.dtype)
    from .models import truncate
    draft = attach_layers(large, cfg.k, extra, norm)
    plain = truncate(large, cfg.k)
    t = time.perf_counter()
    agree = {}
    for name, (full, plens) in eval_seqs.items():
        agree[name] = {"self_draft": agreement(draft, full, plens), f"truncation_k{cfg.k}": agreement(plain, full, plens)}
        log(f"distill: {name}: self-draft agreement {agree[name]['self_draft']['agreement']:.3f}, "
            f"plain truncation {agree[name][f'truncation_k{cfg.k}']['agreement']:.3f}")
    speed = step_time_ratio(draft, large)
    times["eval_s"] = round(time.perf_counter() - t, 1)
    import transformers
    meta = {"base": "SmolLM2-135M-Instruct" if "smollm" in str(getattr(large.config, "_name_or_path", "")).lower()
            or large.config.num_hidden_layers == 30 else str(getattr(large.config, "_name_or_path", "?")),
            "k": cfg.k, "m": cfg.m, "config": asdict(cfg),
            "data": {"train_prompts": len(train_p), "train_positions": data.tokens,
                     "source": "synthetic templated prompts (tokenrouter_sdk.distill.synthetic_prompts, "
                               f"seed {cfg.seed}); no text from the benchmark sets",
                     "heldout": {name: len(v[0]) for name, v in eval_seqs.items()}},
            "train": stats, "agreement": agree, "step_time": speed, "times_s": times,
            "total_s": round(time.perf_counter() - t_all, 1),
            "env": {"torch": torch.__version__, "transformers": transformers.__version__,
                    "threads": torch.get_num_threads(), "python": platform.python_version()}}
    save_self_draft(out, extra, norm, meta)
    return meta


def _enc(tok, prompt: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def add_parser(sub) -> None:
    """Register ``tokenrouter distill`` on an argparse subparsers object."""
    d = DistillConfig()
    p = sub.add_parser("distill", help="rebuild the packaged pair's self-draft small model from scratch (CPU, ~45 min)")
    p.add_argument("--out", default=None, help="output .safetensors (default: a file in the cache folder; the "
                   "packaged one is tokenrouter_sdk/assets/smollm2_self_draft.safetensors)")
    p.add_argument("--k", type=int, default=d.k, help=f"shared layers of the large model (default {d.k})")
    p.add_argument("--m", type=int, default=d.m, help=f"trained layers on top (default {d.m})")
    p.add_argument("--prompts", type=int, default=d.train_prompts, help="synthetic training prompts")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="teacher continuation length")
    p.add_argument("--seconds", type=float, default=d.seconds, help="training wall-clock budget (s)")
    p.add_argument("--epochs", type=int, default=d.max_epochs, help="at most this many epochs")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.set_defaults(fn=_cmd_distill)


def _cmd_distill(args) -> int:
    import json

    from .models import cache_dir, load_model, smollm2_folder
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or str(cache_dir() / "self_draft" / "smollm2_self_draft.safetensors")
    cfg = DistillConfig(k=args.k, m=args.m, train_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                        seconds=args.seconds, max_epochs=args.epochs, lr=args.lr)
    large, tok = load_model(smollm2_folder())
    qs = load_benchmark_rows("gsm8k", cfg.gsm8k_heldout).questions
    meta = distill(large, tok, out, cfg, gsm8k_questions=qs)
    print(json.dumps({k: meta[k] for k in ("agreement", "step_time", "times_s", "total_s")}, indent=1))
    print(f"wrote {out} (+ .json)")
    return 0
