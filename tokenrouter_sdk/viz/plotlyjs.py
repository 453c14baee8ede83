"""Figures that survive export: the mime bundle of a plotly figure in a notebook.

A figure's notebook output carries two forms:

- ``application/vnd.plotly.v1+json``: the figure as data; JupyterLab, Notebook 7 and VS Code
  draw it with their own plotly.js (offline, nothing embedded in the notebook);
- ``text/html``: a ``<div>`` and a short script that draws the figure with ``window.Plotly``,
  loading plotly.js first if the page has none. The script is what nbconvert's HTML export and
  the docs site (mkdocs-jupyter) show. plotly.js is loaded once per page, whatever the number of
  figures: from ``window.TOKENROUTER_PLOTLYJS`` if the page sets it, else from plotly's CDN at
  the version of the installed plotly package. `tokenrouter_sdk.viz.export.export_html` writes an
  exported page with plotly.js inlined once in its head, which opens offline.

No PNG: a static image needs ``kaleido``, which drives a headless Chromium per export (seconds a
figure), so it is left to the reader (``fig.write_image``).
"""

from __future__ import annotations

import json
import uuid

_LOADER = """(function(){
var id=%(id)s, spec=%(spec)s;
function draw(){var el=document.getElementById(id);
 if(el&&window.Plotly){el.textContent="";window.Plotly.newPlot(el,spec.data,spec.layout,spec.config);}}
if(window.Plotly){draw();return;}
var L=window.__tokenrouterPlotly=window.__tokenrouterPlotly||{queue:[],failed:null};
function fail(i){var el=document.getElementById(i);
 if(el){el.textContent="plotly.js could not be loaded from "+L.failed+" (offline?): the figure is not drawn. "+
 "tokenrouter_sdk.viz.export.export_html writes pages that open offline.";}}
if(L.failed){fail(id);return;}
L.queue.push([draw,id]);
if(L.script){return;}
var s=document.createElement("script");
s.src=window.TOKENROUTER_PLOTLYJS||%(url)s; s.charset="utf-8";
s.onload=function(){var q=L.queue;L.queue=[];q.forEach(function(e){e[0]();});};
s.onerror=function(){L.failed=s.src;var q=L.queue;L.queue=[];q.forEach(function(e){fail(e[1]);});};
L.script=s; document.head.appendChild(s);
})();"""


def plotlyjs_url() -> str:
    """The CDN address of the plotly.js version bundled with the installed plotly package."""
    from plotly.offline import get_plotlyjs_version

    return f"https://cdn.plot.ly/plotly-{get_plotlyjs_version()}.min.js"


def _script_json(obj) -> str:
    """JSON safe inside a ``<script>`` element (no ``</script>``, no ``<!--``)."""
    text = obj if isinstance(obj, str) else json.dumps(obj)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def figure_html(fig, div_id: str | None = None) -> str:
    """The HTML form of a plotly figure: a ``<div>`` of the figure's height and a script that
    draws it once plotly.js is on the page (loaded once per page, see the module docstring).

    Args:
        fig: a ``plotly.graph_objects.Figure`` or its dict (``fig.to_plotly_json()``).
        div_id: the ``id`` of the ``<div>`` (default: a fresh ``tr-fig-<12 hex digits>``).

    Returns:
        an HTML fragment (about the size of the figure's JSON plus 1.2 kB).
    """
    import plotly.io as pio

    spec = fig if isinstance(fig, dict) else fig.to_plotly_json()
    div_id = div_id or f"tr-fig-{uuid.uuid4().hex[:12]}"  # unique across kernel sessions
    height = (spec.get("layout") or {}).get("height") or 450
    body = {"data": spec.get("data", []), "layout": spec.get("layout", {}), "config": {"responsive": True}}
    try:
        text = json.dumps(body)  # plain lists and numbers (plotly's own JSON of a figure, the live view)
    except TypeError:  # numpy arrays, dates: plotly's encoder
        text = pio.to_json(body, validate=False)
    return (
        f'<div id="{div_id}" class="tr-plotly" style="height:{int(height)}px;width:100%">'
        f'</div><script type="text/javascript">'
        + _LOADER % {"id": json.dumps(div_id), "spec": _script_json(text), "url": json.dumps(plotlyjs_url())}
        + "</script>"
    )


def figure_bundle(fig, text: str | None = None) -> dict:
    """The notebook mime bundle of a plotly figure: plotly's JSON, the HTML form
    (`figure_html`) and a one-line ``text/plain``.

    Args:
        fig: a ``plotly.graph_objects.Figure``.
        text: the ``text/plain`` form (default: the figure's title).
    """
    import plotly.io as pio

    spec = fig.to_plotly_json()
    bundle = pio.renderers["plotly_mimetype"].to_mimebundle(dict(spec))
    bundle["text/html"] = figure_html(bundle["application/vnd.plotly.v1+json"])
    if text is None:
        title = (spec.get("layout") or {}).get("title") or {}
        title = title.get("text") if isinstance(title, dict) else title
        text = f"<plotly figure: {title or 'untitled'}>"
    bundle["text/plain"] = text
    return bundle
