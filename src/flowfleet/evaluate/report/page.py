"""The page: one self-contained HTML file (images embedded) from the report's sections."""

from __future__ import annotations

import time

import jinja2

from flowfleet.evaluate.report.parts import Section

TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>flowfleet report: {{ name }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
nav a { margin-right: 1em; } section { border-top: 1px solid #ccc; padding-top: .5em; margin-top: 1.5em; }
table { border-collapse: collapse; margin: .5em 0 1em; font-size: 90%; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; }
figure { display: inline-block; margin: .5em; vertical-align: top; } figcaption { font-size: 85%; color: #555; }
img { max-width: 100%; image-rendering: pixelated; } pre { background: #f6f6f6; padding: .8em; overflow-x: auto; }
.missing { color: #a60; } ol.prompts { columns: 3; font-size: 80%; }
</style></head><body>
<h1>flowfleet report: {{ name }}</h1>
<p>Generated {{ created }} from {{ url }}.</p>
<nav>{% for s in sections %}<a href="#{{ s.id }}">{{ s.title }}</a>{% endfor %}</nav>
{% for s in sections %}
<section id="{{ s.id }}"><h2>{{ s.title }}</h2>
{% if s.missing %}<p class="missing">Not available: {{ s.missing }}</p>{% endif %}
{% for n in s.notes %}<p>{{ n }}</p>{% endfor %}
{% for t in s.tables %}<table><caption>{{ t.caption }}</caption>
<tr>{% for h in t.header %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in t.rows %}<tr>{% for c in row %}<td>{{ c }}</td>{% endfor %}</tr>{% endfor %}
</table>{% endfor %}
{% if s.pre %}<details><summary>run.yaml and the evaluation's settings</summary><pre>{{ s.pre }}</pre></details>{% endif %}
{% for im in s.images %}<figure><img src="{{ im.data }}" alt="{{ im.caption }}"><figcaption>{{ im.caption }}</figcaption></figure>{% endfor %}
{% for l in s.lists %}<details><summary>{{ l.caption }}</summary><ol class="prompts" start="0">{% for item in l["items"] %}<li>{{ item }}</li>{% endfor %}</ol></details>{% endfor %}
</section>
{% endfor %}
</body></html>
"""


def render(sections: list[Section], *, name: str, url: str) -> str:
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(TEMPLATE).render(
        sections=sections, name=name, url=url, created=time.strftime("%Y-%m-%d %H:%M:%S")
    )
