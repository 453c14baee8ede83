"""`EvalResult`: the table of a quality sweep, with its configuration and per-question answers;
save/load as CSV + JSON + an offline HTML plot."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

TABLE_COLUMNS = [("label", "point", "{}"), ("accuracy", "acc", "{:.3f}"), ("acc_ci", "95% CI", "{}"),
                 ("agreement", "agree_L", "{:.3f}"), ("hop_rate", "hop_rate", "{:.4f}"),
                 ("large_fraction", "large_frac", "{:.3f}"), ("throughput_tok_s", "tok/s", "{:.1f}"),
                 ("mean_latency_s", "latency_s", "{:.2f}"), ("tokens_per_answer", "tok/ans", "{:.1f}")]
RESULTS_JSON, RESULTS_CSV, PLOT_HTML = "results.json", "results.csv", "plot.html"


@dataclass
class EvalResult:
    """A sweep's outcome.

    Attributes:
        records: one dict per operating point (pandas-friendly), with ``label``, ``kind``
            (``"sweep"``, ``"large_only"``, ``"small_only"``, ``"random"``, ``"random_query"``),
            ``policy``, ``param``, ``value``, ``n``, ``correct``, ``accuracy``, ``acc_ci_low``,
            ``acc_ci_high`` (Wilson 95%), ``agreement`` (share of questions whose extracted
            answer equals the large-only one; None without the large-only reference),
            ``answered``, ``hop_rate`` (handoffs / committed token), ``large_fraction``,
            ``throughput_tok_s`` (committed tokens / s), ``mean_latency_s`` (s),
            ``tokens_per_answer`` (tokens), ``committed_tokens``, ``wall_s``, ``hops``,
            ``failed``, ``matched_to``, ``config_hash``, ``resumed``, ``prompt_tokens`` (tokens
            the requests brought to each model they arrived at, summed over models),
            ``prefix_hit_tokens`` (of which taken from the prefix cache), ``prompt_tokens_fed``
            (prefilled).
        config: the full configuration (models, engine, dataset + ids, sampling, concurrency,
            library versions, policy per point).
        answers: label -> per-question dicts (``id``, ``text``, ``pred``, ``correct``,
            ``agrees``, ``tokens``, ``large_tokens``, ``hops``).
    """

    records: list[dict]
    config: dict = field(default_factory=dict)
    answers: dict = field(default_factory=dict)

    def to_pandas(self):
        """The records as a `pandas.DataFrame` (one row per operating point)."""
        import pandas as pd
        return pd.DataFrame(self.records)

    def _table_rows(self) -> list[list[str]]:
        rows = [[h for _, h, _ in TABLE_COLUMNS]]
        for r in self.records:
            row = []
            for key, _, fmt in TABLE_COLUMNS:
                v = f"[{r['acc_ci_low']:.2f},{r['acc_ci_high']:.2f}]" if key == "acc_ci" else r.get(key)
                row.append("-" if v is None else fmt.format(v))
            rows.append(row)
        return rows

    def table(self) -> str:
        """Plain-text table: point, accuracy with 95% CI, agreement with large-only, hop rate,
        large fraction, throughput (tokens/s), mean latency (s), tokens per answer; then the
        `notes`."""
        rows = self._table_rows()
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        text = "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                         for row in rows)
        return "\n".join([text, *self.notes()])

    @property
    def excluded(self) -> dict | None:
        """The questions left out because a swept policy's learned head saw them (``heads``:
        head -> ids its record lists; ``in_draw`` of the ``draw`` questions drawn;
        ``in_benchmark``; ``ids``), or None when none was left out."""
        return self.config.get("excluded")

    def notes(self) -> list[str]:
        """Lines on what was measured: questions left out for the heads' training data (or scored
        although a head saw them) and references that did not realise their target."""
        out, ds = [], self.config.get("dataset", {})
        ex, ov = self.config.get("excluded"), self.config.get("head_overlap")
        if ex:
            heads = ", ".join(f"{k} ({v} ids)" for k, v in ex["heads"].items())
            out.append(f"questions: {ds.get('n', '?')} of {ds.get('name', 'the benchmark')}, leaving out "
                       f"{ex['in_draw']} of the {ex['draw']} first drawn that the learned heads were trained, "
                       f"validated or calibrated on ({heads})")
        if ov:
            out.append(f"questions: {ov['n']} of the {ds.get('n', '?')} scored were used to make the learned heads "
                       f"(exclude_head_questions=False)")
        for r in self.records:
            if r.get("matches_target") is False:
                lo, hi = r["target_range"]
                out.append(f"reference {r['label']} realised {r['realised']:.3g}, outside the 95% range "
                           f"[{lo:.3g}, {hi:.3g}] of its target {r['target']:g}: it does not match {r['matched_to']}")
        return out

    def plot(self, x: str = "throughput", y: str = "accuracy"):
        """plotly Figure of ``y`` (``"accuracy"`` or ``"agreement"``) against ``x``
        (``"throughput"``, ``"large_fraction"`` or ``"hop_rate"``), with the Pareto frontier and
        the reference points. Shows inline in a notebook, and in exported notebooks and the docs
        (a `tokenrouter_sdk.viz.nbfigure.NotebookFigure`: plotly's JSON with an HTML form)."""
        from .plots import quality_figure
        ds = self.config.get("dataset", {})
        title = f"{ds.get('name', '')} (n={ds.get('n', '?')}): {y} vs {x}"
        return quality_figure(self.records, x=x, y=y, title=title)

    def frontier(self, x: str = "throughput", y: str = "accuracy") -> list[str]:
        """Labels of the Pareto-optimal points (see `tokenrouter_sdk.eval.plots.pareto_frontier`)."""
        from .plots import X_AXES, pareto_frontier
        xcol, _, higher = X_AXES[x]
        rows = [r for r in self.records if r.get(y) is not None]
        return [rows[i]["label"] for i in pareto_frontier([(r[xcol], r[y]) for r in rows], higher)]

    def save(self, folder) -> Path:
        """Write ``results.csv``, ``results.json`` (records, config, answers) and ``plot.html``
        (both plots, plotly.js inlined: opens offline). Returns the folder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        keys = list(dict.fromkeys(k for r in self.records for k in r))
        with open(folder / RESULTS_CSV, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.records)
        tmp = folder / (RESULTS_JSON + ".tmp")
        tmp.write_text(json.dumps({"records": self.records, "config": self.config, "answers": self.answers},
                                  indent=1, default=str), encoding="utf-8")
        tmp.replace(folder / RESULTS_JSON)
        try:
            figs = [self.plot("throughput"), self.plot("large_fraction")]
        except ImportError:  # plotly is an optional extra
            return folder
        if any(r.get("agreement") is not None for r in self.records):
            figs += [self.plot("throughput", "agreement"), self.plot("large_fraction", "agreement")]
        body = "".join(f.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figs))
        (folder / PLOT_HTML).write_text(f"<html><head><meta charset='utf-8'><title>quality at hop rate</title>"
                                        f"</head><body>{body}<pre>{self.table()}</pre></body></html>",
                                        encoding="utf-8")
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
        return cls(d["records"], d.get("config", {}), d.get("answers", {}))

    def __repr__(self) -> str:
        return f"EvalResult({len(self.records)} points)\n{self.table()}"

    def _repr_html_(self) -> str:
        """The `table` as HTML (the same columns and formats)."""
        from ..viz.tables import html_table
        head, *rows = self._table_rows()
        ds = self.config.get("dataset", {})
        return html_table(head, rows, caption=f"{ds.get('name', 'sweep')} (n={ds.get('n', '?')}): "
                                              f"{len(self.records)} points")
