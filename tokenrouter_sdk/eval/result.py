"""`EvalResult`: the table of a quality sweep, with its configuration, per-question answers and
paired statistics; save/load as CSV + JSON + an offline HTML plot."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

# (record key, header, format); "acc_ci" and "tok_s" are drawn from several keys
TABLE_COLUMNS = [
    ("label", "point", "{}"),
    ("failed", "failed", "{}"),
    ("accuracy", "acc", "{:.3f}"),
    ("acc_ci", "95% CI", "{}"),
    ("no_answer", "no_ans", "{:.3f}"),
    ("agreement", "ans_agree", "{:.3f}"),
    ("token_agreement_prefix", "tok_agree", "{:.3f}"),
    ("hop_rate", "hop_rate", "{:.4f}"),
    ("writer_change_rate", "writer_chg", "{:.4f}"),
    ("large_fraction", "large_frac", "{:.3f}"),
    ("tok_s", "tok/s (min-max)", "{}"),
    ("tok_per_cpu_s", "tok/cpu_s", "{:.1f}"),
    ("mean_latency_s", "latency_s", "{:.2f}"),
    ("tokens_per_answer", "tok/ans", "{:.1f}"),
]
SUMMARY_KEYS = ("apgr", "large_fraction_50", "large_fraction_80")
SUMMARY_NAMES = {"apgr": "APGR", "large_fraction_50": "large_frac@50%", "large_fraction_80": "large_frac@80%"}
RESULTS_JSON, RESULTS_CSV, PLOT_HTML, FIGURES_DIR = "results.json", "results.csv", "plot.html", "figures"
_CSV_SKIP = (
    "throughput_runs",
    "prompt_fed_runs",
    "matched_points",
    "targets",
    "calibration",
)  # lists and dicts: in results.json only


@dataclass
class EvalResult:
    """A sweep's outcome.

    Attributes:
        records: one dict per operating point (pandas-friendly), with ``label``, ``kind``
            (``"sweep"``, ``"large_only"``, ``"small_only"``, ``"random"``, ``"random_span"``,
            ``"random_query"``), ``policy`` (class), ``policy_name`` (the name given to
            `evaluate_policies`), ``param``, ``value``; the counts ``n`` (questions),
            ``answered`` (requests that finished), ``failed`` (failed or aborted), ``flagged``
            (any failed) and ``first_error``; over the answered requests ``correct``,
            ``accuracy`` with its Wilson 95% interval ``acc_ci_low`` / ``acc_ci_high`` (None when
            none was answered), ``extracted`` (share with a final answer found) and
            ``no_answer`` (share without one: never correct, never agreeing),
            ``agreement`` (share of the questions both answered whose extracted answer equals
            large-only's, a missing answer on either side counting as a disagreement;
            ``agreement_n`` of them; None without large-only),
            ``token_agreement_prefix`` and ``token_agreement`` (positions equal to large-only's
            output before the first divergence, and overall, per position of the longer
            output), ``hops`` and ``hop_rate`` (handoffs per committed token, docs/metrics.md),
            ``writer_changes`` and ``writer_change_rate``, ``large_fraction``,
            ``mean_large_visit`` / ``mean_small_visit`` (tokens per visit, `stats.mean_visits`),
            ``tokens_per_answer`` and ``committed_tokens``; the timing of its ``repeats`` runs:
            ``throughput_tok_s`` (median, committed tokens / s), ``throughput_min``,
            ``throughput_max``, ``throughput_spread`` ((max - min) / median),
            ``throughput_runs``, ``tok_per_cpu_s``, ``cpu_s``, ``wall_s``, ``mean_latency_s``
            (s), ``other_share`` (share of the CPUs other processes used), ``prompt_tokens``,
            ``prefix_hit_tokens``, ``prompt_tokens_fed`` and ``prompt_fed_runs`` (per run and
            model, prompt tokens prefilled: the cache state each run found),
            ``repeat_mismatches``; references' ``matched_to``, ``matched_points``, ``targets``
            and their checks (``target``, ``realised``, ``target_range``, ``matches_target``);
            ``config_hash``, ``resumed``; a point calibrated to a large share
            (``target_large_share=``): ``target_large_share`` and ``calibration``
            (`tokenrouter_sdk.eval.calibrate.Calibration` as a dict, less its ids: the threshold,
            the share realised on the held-out questions, its runs).
        config: the full configuration (models, engine, dataset + ids, sampling, concurrency,
            timing protocol, machine load, library versions, policy per point, skipped
            references, the order the runs were timed in).
        answers: label -> per-question dicts (``id``, ``ok``, ``text``, ``pred``, ``correct``,
            ``agrees``, ``tokens``, ``large_tokens``, ``hops``, ``writer_changes``, ``error``,
            ``token_ids``, ``visits``: ``[model, committed tokens]`` per visit in order, a visit
            starting at admission and at each handoff).
        stats: ``paired`` (per swept point and comparator: ``n`` questions both answered,
            ``acc_diff`` and ``agree_diff`` with bootstrap 95% intervals) and ``summaries`` (per
            policy and quality measure: RouteLLM's ``apgr``, ``large_fraction_50``,
            ``large_fraction_80``).
    """

    records: list[dict]
    config: dict = field(default_factory=dict)
    answers: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)

    def to_pandas(self):
        """The records as a `pandas.DataFrame` (one row per operating point)."""
        import pandas as pd

        return pd.DataFrame(self.records)

    @property
    def paired(self) -> list[dict]:
        """The paired comparisons on the same questions (see ``stats``)."""
        return list(self.stats.get("paired") or [])

    @property
    def summaries(self) -> list[dict]:
        """RouteLLM's summaries per policy (see ``stats``)."""
        return list(self.stats.get("summaries") or [])

    @property
    def failures(self) -> list[dict]:
        """The points with failed requests: ``label``, ``failed``, ``n``, ``first_error``."""
        return [
            {"label": r["label"], "failed": r["failed"], "n": r.get("n"), "first_error": r.get("first_error")}
            for r in self.records
            if r.get("failed")
        ]

    def _columns(self) -> list[tuple]:
        """`TABLE_COLUMNS`, with the target large share beside the realised one when a point was
        calibrated to one (``target_large_share``)."""
        if not any(r.get("target_large_share") is not None for r in self.records):
            return TABLE_COLUMNS
        k = next(n for n, c in enumerate(TABLE_COLUMNS) if c[0] == "large_fraction")
        return [*TABLE_COLUMNS[: k + 1], ("target_large_share", "target", "{:.3f}"), *TABLE_COLUMNS[k + 1 :]]

    def _table_rows(self) -> list[list[str]]:
        cols = self._columns()
        rows = [[h for _, h, _ in cols]]
        for r in self.records:
            row = []
            for key, _, fmt in cols:
                if key == "acc_ci":
                    lo, hi = r.get("acc_ci_low"), r.get("acc_ci_high")
                    row.append("-" if lo is None or hi is None else f"[{lo:.2f},{hi:.2f}]")
                    continue
                if key == "tok_s":
                    v, lo, hi = r.get("throughput_tok_s"), r.get("throughput_min"), r.get("throughput_max")
                    row.append(
                        "-"
                        if v is None
                        else f"{v:.1f}"
                        + (f" ({lo:.1f}-{hi:.1f})" if lo is not None and r.get("repeats", 1) > 1 else "")
                    )
                    continue
                if key == "failed":
                    f, n = r.get("failed"), r.get("n")
                    row.append("-" if f is None else (f"{f}/{n} !" if f else "0"))
                    continue
                v = r.get(key)
                row.append("-" if v is None else fmt.format(v))
            rows.append(row)
        return rows

    def table(self) -> str:
        """Plain-text table: point, failed requests, accuracy with 95% CI, share without an
        extracted answer, agreement with large-only (answers, then tokens), hop rate, writer
        changes per token, large fraction (and the target large share of calibrated points),
        throughput (median tokens/s with its min-max over the repeats), tokens per CPU-second,
        mean latency (s), tokens per answer; the RouteLLM summaries and paired differences; then
        the `notes`."""
        from ..tables import text_table

        head, *rows = self._table_rows()
        top = self.question_lines()
        parts = top + [text_table(head, rows, align="l" + "r" * (len(head) - 1))]
        if self.summaries:
            parts.append("\n" + self.summary_table())
        if self.paired:
            parts.append("\n" + self.paired_table())
        notes = [n for n in self.notes() if n not in top]
        if notes:
            parts.append("\n" + "\n".join(notes))
        return "\n".join(parts)

    def question_set(self) -> str | None:
        """A short fingerprint of the question ids every point was scored on (the first 8 hex
        digits of their sha256): two results with the same fingerprint scored the same
        questions. None when the configuration holds no ids."""
        ids = (self.config.get("dataset") or {}).get("ids")
        if not ids:
            return None
        import hashlib

        return hashlib.sha256("\n".join(map(str, ids)).encode()).hexdigest()[:8]

    def question_lines(self) -> list[str]:
        """The lines printed above the table: the questions every point and reference was scored
        on (how many, of which benchmark, the draw and the set's fingerprint), and the questions
        left out for the learned heads' training data (or scored although a head saw them)."""
        ds = self.config.get("dataset") or {}
        if not ds:
            return []
        seed = ds.get("seed")
        draw = "file order" if seed is None else f"seed {seed}"
        out = [
            f"questions: {ds.get('n', '?')} of {ds.get('name', 'the benchmark')} ({draw}; set "
            f"{self.question_set() or '?'}), the same for every point and reference"
        ]
        ex, ov = self.config.get("excluded"), self.config.get("head_overlap")
        if ex and not ex["in_draw"]:
            heads = ", ".join(f"{k} ({v} ids)" for k, v in ex["heads"].items())
            out.append(f"questions: none of them was used to train, validate or calibrate the learned heads ({heads})")
        elif ex:
            heads = ", ".join(f"{k} ({v} ids)" for k, v in ex["heads"].items())
            out.append(
                f"questions: {ds.get('n', '?')} of {ds.get('name', 'the benchmark')}, leaving out "
                f"{ex['in_draw']} of the {ex['draw']} first drawn that the learned heads were trained, "
                f"validated or calibrated on ({heads}); the next questions in the same order took their "
                f"places, for every policy and reference alike"
            )
        if ov:
            out.append(
                f"questions: {ov['n']} of the {ds.get('n', '?')} scored were used to make the learned heads "
                f"(exclude_head_questions=False)"
            )
        return out

    def _summary_rows(self):
        head = ["policy", "quality", "points", "failed", "APGR", "large_frac@50%", "large_frac@80%"]
        rows = []
        for s in self.summaries:
            rows.append(
                [
                    s["policy"],
                    s["metric"],
                    s["points"],
                    s["failed"],
                    *("n/a" if s.get(k) is None else f"{s[k]:.3f}" for k in SUMMARY_KEYS),
                ]
            )
        return head, rows

    def summary_reasons(self) -> list[str]:
        """Why each ``n/a`` of the summary table is not a number (one line per policy, quality
        measure and reason)."""
        out = []
        for s in self.summaries:
            why = s.get("why_na") or ({k: s["why"] for k in SUMMARY_KEYS} if s.get("why") else {})
            reasons: dict[str, list[str]] = {}
            for k in SUMMARY_KEYS:
                if s.get(k) is None and why.get(k):
                    reasons.setdefault(why[k], []).append(SUMMARY_NAMES[k])
            out += [f"n/a: {s['policy']} {s['metric']} {', '.join(names)}: {text}" for text, names in reasons.items()]
        return out

    def summary_table(self) -> str:
        """Per policy and quality measure: RouteLLM's APGR (the average share of the large-only
        gain recovered over the large fraction) and the large fraction that reaches 50% and 80%
        of that gain (arXiv 2406.18665, section 5.1), each ``n/a`` where the policy's points do
        not carry it, with the reason under the table (`tokenrouter_sdk.eval.stats.gain_summary`)."""
        from ..tables import text_table

        head, rows = self._summary_rows()
        reasons = self.summary_reasons()
        return (
            "RouteLLM summaries (cost = large fraction)\n"
            + text_table(head, rows, align="llrrrrr")
            + ("\n" + "\n".join(reasons) if reasons else "")
        )

    def _paired_rows(self):
        head = ["point", "vs", "n", "failed", "acc diff [95% CI]", "agree diff [95% CI]"]

        def fmt(d, ci):
            return "-" if d is None else f"{d:+.3f} [{ci[0]:+.3f},{ci[1]:+.3f}]"

        rows = [
            [
                p["point"],
                p["vs"],
                p["n"],
                p.get("failed", 0),
                fmt(p["acc_diff"], p["acc_diff_ci"]),
                fmt(p["agree_diff"], p["agree_diff_ci"]),
            ]
            for p in self.paired
        ]
        return head, rows

    def paired_table(self) -> str:
        """Paired differences on the questions both points answered: accuracy and agreement of
        each swept point minus its comparator's, with percentile bootstrap 95% intervals."""
        from ..tables import text_table

        head, rows = self._paired_rows()
        return "paired differences on the same questions (point - vs)\n" + text_table(head, rows, align="llrrrr")

    @property
    def excluded(self) -> dict | None:
        """The questions left out because a swept policy's learned head saw them (``heads``:
        head -> ids its record lists; ``in_draw`` of the ``draw`` questions drawn;
        ``in_benchmark``; ``ids``), or None when none was left out."""
        return self.config.get("excluded")

    def notes(self) -> list[str]:
        """Lines on what was measured: points with failed requests, references skipped or off
        their target, questions left out for the heads' training data (or scored although a
        head saw them), the timing protocol and the machine's load."""
        out = []
        for r in self.records:
            if r.get("failed"):
                out.append(
                    f"FAILED: {r['label']}: {r['failed']} of {r.get('n', '?')} requests failed; its numbers are "
                    f"over the {r.get('answered', '?')} answered. First error: {r.get('first_error')}"
                )
        for s in self.config.get("skipped_references") or ():
            out.append(f"references {', '.join(s['references'])} not run for {s['point']}: {s['why']}")
        if self.records and not any(r.get("kind") == "large_only" for r in self.records):
            out.append("agreement: not measured (it needs the large_only reference)")
        out += self.question_lines()[1:]
        for r in self.records:
            if r.get("matches_target") is False:
                lo, hi = r["target_range"]
                extra = (
                    ""
                    if r.get("visits_match", True)
                    else (
                        f"; mean visits {r.get('realised_large_visit')} / {r.get('realised_small_visit')} against "
                        f"ranges {r.get('large_visit_range')} / {r.get('small_visit_range')}"
                    )
                )
                out.append(
                    f"reference {r['label']} realised {r['realised']:.3g}, 95% range [{lo:.3g}, {hi:.3g}] of its "
                    f"target {r['target']:g}{extra}: it does not match {r['matched_to']}"
                )
        for r in self.records:
            cal = r.get("calibration")
            if cal:
                got = r.get("large_fraction")
                out.append(
                    f"calibrated: {r['label']}: {cal['param']}={cal['threshold']:g} for a large share of "
                    f"{cal['target']:g}: {cal['large_fraction']:.3f} on the {cal['n_prompts']} held-out "
                    f"calibration questions ({len(cal['rounds'])} runs"
                    + ("" if cal["within_tol"] else f", none within {cal['tol']:g}")
                    + "), "
                    + ("-" if got is None else f"{got:.3f}")
                    + " on the questions evaluated"
                )
        mism = [r["label"] for r in self.records if r.get("repeat_mismatches")]
        if mism:
            out.append(
                f"repeats wrote other tokens than the first run for {', '.join(mism)} (answers are the first run's)"
            )
        t = self.config.get("timing")
        if t:
            out.append(
                f"timing: {t['repeats']} run(s) per point, {t['order']}; cache: {t['cache_rule']}; "
                f"{t.get('clock', 'wall')} clock"
            )
        m = self.config.get("machine")
        if m and m.get("other_share_median") is not None and (t or {}).get("clock") != "simulated":
            out.append(
                f"machine: {m['cpus']} CPUs; other processes used {m['other_share_median']:.0%} of them in the "
                f"median run (max {m['other_share_max']:.0%}), load average up to {m['load_1m_max']:.2f}"
                + (": UNDER LOAD, compare throughputs from a quiet machine" if m.get("high") else "")
            )
        return out

    def plot(self, x: str = "throughput", y: str = "accuracy"):
        """plotly Figure of ``y`` (``"accuracy"`` or ``"agreement"``) against ``x``
        (``"throughput"``, ``"large_fraction"`` or ``"hop_rate"``), with the Pareto frontier and
        the reference points; points with failed requests are ringed and their hover says how
        many. Shows inline in a notebook, and in exported notebooks and the docs (a
        `tokenrouter_sdk.viz.nbfigure.NotebookFigure`: plotly's JSON with an HTML form)."""
        from .plots import quality_figure

        return quality_figure(self.records, x=x, y=y, title=self._title(x, y))

    def plots(self) -> list[tuple[str, str]]:
        """The ``(x, y)`` of every plot the sweep's files hold: accuracy against throughput and
        against large fraction, and the same for agreement when large-only was run."""
        out = [("throughput", "accuracy"), ("large_fraction", "accuracy")]
        if any(r.get("agreement") is not None for r in self.records):
            out += [("throughput", "agreement"), ("large_fraction", "agreement")]
        return out

    def _title(self, x: str, y: str) -> str:
        ds = self.config.get("dataset", {})
        return f"{ds.get('name', '')} (n={ds.get('n', '?')}): {y} vs {x}"

    def static_plot(self, x: str = "throughput", y: str = "accuracy"):
        """`plot` as a static matplotlib Figure, for a paper (``fig.savefig("acc.pdf")``; see
        `tokenrouter_sdk.eval.static_plots.static_figure`).

        Raises:
            ImportError: matplotlib is not installed (``pip install 'tokenrouter-sdk[figures]'``).
        """
        from .static_plots import static_figure

        return static_figure(self.records, x=x, y=y, title=self._title(x, y))

    def save_figures(self, folder, formats=("png", "pdf")) -> list[Path]:
        """Write every plot of `plots` as a static figure into ``folder``, one file per plot and
        format: ``accuracy_vs_throughput.png``, ``accuracy_vs_throughput.pdf``, ... (formats
        among png, pdf, svg). Returns the paths.

        Raises:
            ImportError: matplotlib is not installed (``pip install 'tokenrouter-sdk[figures]'``).
            ValueError: an unknown format.
        """
        from .static_plots import save_static

        return save_static(self.records, folder, self.plots(), formats=formats, title_of=self._title)

    def frontier(self, x: str = "throughput", y: str = "accuracy") -> list[str]:
        """Labels of the Pareto-optimal points (see `tokenrouter_sdk.eval.plots.pareto_frontier`)."""
        from .plots import X_AXES, pareto_frontier

        xcol, _, higher = X_AXES[x]
        rows = [r for r in self.records if r.get(y) is not None and r.get(xcol) is not None]
        return [rows[i]["label"] for i in pareto_frontier([(r[xcol], r[y]) for r in rows], higher)]

    def save(self, folder) -> Path:
        """Write ``results.csv``, ``results.json`` (records, config, answers, stats),
        ``plot.html`` (the plots, plotly.js inlined: opens offline; needs plotly) and every
        plot as PNG and PDF under ``figures/`` (`save_figures`; needs matplotlib, the
        ``figures`` extra). What an optional library's absence leaves out is skipped. Returns
        the folder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        keys = [k for k in dict.fromkeys(k for r in self.records for k in r) if k not in _CSV_SKIP]
        with open(folder / RESULTS_CSV, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(self.records)
        tmp = folder / (RESULTS_JSON + ".tmp")
        tmp.write_text(
            json.dumps(
                {"records": self.records, "config": self.config, "answers": self.answers, "stats": self.stats},
                indent=1,
                default=str,
            ),
            encoding="utf-8",
        )
        tmp.replace(folder / RESULTS_JSON)
        try:
            self.save_figures(folder / FIGURES_DIR)
        except ImportError:  # matplotlib is an optional extra
            pass
        try:
            figs = [self.plot(x, y) for x, y in self.plots()]
        except ImportError:  # plotly is an optional extra
            return folder
        body = "".join(f.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figs))
        import html as _html

        (folder / PLOT_HTML).write_text(
            f"<html><head><meta charset='utf-8'><title>quality at hop rate</title>"
            f"</head><body>{body}<pre>{_html.escape(self.table())}</pre></body></html>",
            encoding="utf-8",
        )
        return folder

    @classmethod
    def load(cls, folder) -> "EvalResult":
        """Read a result written by `save`.

        Raises:
            FileNotFoundError: ``folder/results.json`` does not exist.
        """
        path = Path(folder) / RESULTS_JSON
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: pass the folder given to EvalResult.save / --out")
        d = json.loads(path.read_text(encoding="utf-8"))
        return cls(d["records"], d.get("config", {}), d.get("answers", {}), d.get("stats", {}))

    def __repr__(self) -> str:
        return f"EvalResult({len(self.records)} points)\n{self.table()}"

    def _repr_html_(self) -> str:
        """The `table`, the summaries and the paired differences as HTML (the same columns and
        formats), then the notes."""
        import html as _html

        from ..tables import html_table

        head, *rows = self._table_rows()
        ds = self.config.get("dataset", {})
        top = self.question_lines()
        out = "".join(f"<p>{_html.escape(line)}</p>" for line in top)
        out += html_table(
            head, rows, caption=f"{ds.get('name', 'sweep')} (n={ds.get('n', '?')}): {len(self.records)} points"
        )
        if self.summaries:
            h, r = self._summary_rows()
            out += html_table(h, r, caption="RouteLLM summaries (cost = large fraction)", align="llrrrrr")
            reasons = self.summary_reasons()
            if reasons:
                out += "<ul>" + "".join(f"<li>{_html.escape(n)}</li>" for n in reasons) + "</ul>"
        if self.paired:
            h, r = self._paired_rows()
            out += html_table(h, r, caption="paired differences on the same questions (point - vs)", align="llrrrr")
        notes = [n for n in self.notes() if n not in top]
        if notes:
            out += "<ul>" + "".join(f"<li>{_html.escape(n)}</li>" for n in notes) + "</ul>"
        return out
