"""The chat page's Markdown renderer (pagoda/entrypoints/openai/web/markdown.js), run
in Node: exact HTML for each construct, and nothing unsafe out of hostile input.
Skipped where Node is not installed (Debian: `apt-get install nodejs`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pagoda.entrypoints.openai import web_ui

NODE = shutil.which("node") or shutil.which("nodejs")
pytestmark = pytest.mark.skipif(
    NODE is None,
    reason="Node.js is not installed (apt-get install nodejs); the browser tests cover the page",
)
SCRIPT = Path(web_ui.__file__).parent / "web" / "markdown.js"

CASES = {
    "plain": ("Hello", "<p>Hello</p>"),
    "lines": ("one\ntwo\n\nthree", "<p>one<br>two</p>\n<p>three</p>"),
    "escape": ("a < b & \"c\" 'd'", "<p>a &lt; b &amp; &quot;c&quot; &#39;d&#39;</p>"),
    "emphasis": (
        "**bold** and *it* and _it2_ and ~~gone~~",
        "<p><strong>bold</strong> and <em>it</em> and <em>it2</em> and <del>gone</del></p>",
    ),
    "snake_case": ("call my_func_name now", "<p>call my_func_name now</p>"),
    "arithmetic": ("2 * 3 * 4", "<p>2 * 3 * 4</p>"),
    "inline code": (
        "use `a*b*c` or `<x>`",
        "<p>use <code>a*b*c</code> or <code>&lt;x&gt;</code></p>",
    ),
    "fence": (
        "```python\ndef f():\n    return 1 < 2\n```\nafter",
        '<pre><code class="language-python">def f():\n    return 1 &lt; 2</code></pre>\n<p>after</p>',
    ),
    "open fence": ("```\nstill streaming", "<pre><code>still streaming</code></pre>"),
    "heading": ("## Title ##", "<h2>Title</h2>"),
    "bullets": (
        "- a\n- **b**\n\n1. x\n2. y",
        "<ul><li>a</li><li><strong>b</strong></li></ul>\n<ol><li>x</li><li>y</li></ol>",
    ),
    "numbered start": ("3. c\n4. d", '<ol start="3"><li>c</li><li>d</li></ol>'),
    "quote": ("> said\n> twice", "<blockquote>said<br>twice</blockquote>"),
    "rule": ("a\n\n---\n\nb", "<p>a</p>\n<hr>\n<p>b</p>"),
    "link": (
        "[docs](https://example.org/a_b?x=1&y=2)",
        '<p><a href="https://example.org/a_b?x=1&amp;y=2" target="_blank" '
        'rel="noopener noreferrer">docs</a></p>',
    ),
    "unsafe link": ("[click](javascript:alert(1))", "<p>click</p>"),
    "data link": ("[x](data:text/html,hi)", "<p>x</p>"),
    "parenthesised url": (
        "[w](https://en.wikipedia.org/wiki/C_(language))",
        '<p><a href="https://en.wikipedia.org/wiki/C_(language)" target="_blank" '
        'rel="noopener noreferrer">w</a></p>',
    ),
}
ALLOWED_TAGS = {
    "p",
    "br",
    "strong",
    "em",
    "del",
    "code",
    "pre",
    "a",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "ul",
    "ol",
    "li",
    "blockquote",
    "hr",
}

HOSTILE = [
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    '[x](https://a.org/"onmouseover="alert(1))',
    "```\n</code></pre><script>alert(1)</script>\n```",
    "`</code><img src=x onerror=1>`",
    "[a](JAVASCRIPT:alert(1)) [b](  javascript:alert(1))",
    "\u0000" + "0" + "\u0000 placeholder smuggling",
]


def _render(sources: list[str]) -> list[str]:
    program = (
        f"const md = require({json.dumps(str(SCRIPT))});"
        "const input = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        "process.stdout.write(JSON.stringify(input.map(md.renderMarkdown)));"
    )
    done = subprocess.run(
        [NODE, "-e", program],
        input=json.dumps(sources),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout)


def test_each_construct_renders_exactly():
    names = list(CASES)
    outputs = _render([CASES[name][0] for name in names])
    for name, output in zip(names, outputs):
        assert output == CASES[name][1], name


def test_hostile_input_yields_no_live_markup():
    for source, html in zip(HOSTILE, _render(HOSTILE)):
        assert "<script" not in html and "<img" not in html, (source, html)
        assert "javascript:" not in html.lower() or "href" not in html, (source, html)
        # Only the renderer's own tags and attributes.
        for tag, attrs in re.findall(r"<([a-z0-9]+)((?:\s[^>]*)?)>", html):
            assert tag in ALLOWED_TAGS, (source, html)
            # Every attribute is name="value" with no quote inside: no way out of a value.
            assert re.fullmatch(r'(\s[a-z-]+="[^"<>]*")*', attrs), (source, html)
            names = set(re.findall(r'\s([a-z-]+)="', attrs))
            assert names <= {"href", "target", "rel", "class", "start"}, (source, html)
        assert "\u0000" not in html
