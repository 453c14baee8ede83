"""`HTMLView`: an HTML fragment that Jupyter renders and a terminal prints as text."""

from __future__ import annotations

from pathlib import Path


class HTMLView:
    """An HTML fragment: rendered by Jupyter (``_repr_html_``), plain text in a terminal
    (``repr``: the answers with ``[S:...]`` style markers), written with `save`."""

    def __init__(self, html_text: str, text: str = ""):
        self.html = html_text
        self.text = text

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return self.text or self.html

    def save(self, path) -> Path:
        """Write a standalone HTML page to ``path``; returns the path."""
        p = Path(path)
        p.write_text(
            f"<!doctype html><html><head><meta charset='utf-8'></head><body>{self.html}</body></html>", encoding="utf-8"
        )
        return p
