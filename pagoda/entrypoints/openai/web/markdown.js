// A small Markdown renderer for model output: renderMarkdown(text) -> HTML string.
// Safety first: all text is HTML-escaped before any markup is produced, so the only
// tags in the result are the ones made here, and a link gets an href only when it is
// http(s): or mailto: (never javascript: or data:). Quotes are escaped too, so an
// escaped URL cannot leave its attribute.
// Supported: fenced code blocks (``` or ~~~, an unclosed fence runs to the end, as a
// reply still streaming has), inline code, headings, bold, italic, strikethrough,
// links, flat bulleted and numbered lists, block quotes, rules, paragraphs (single
// newlines kept as line breaks). Usable from the page (window.PagodaMarkdown) and
// from Node (module.exports) for tests.
"use strict";

(function (root) {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const SAFE_URL = /^(https?:\/\/|mailto:)[^\s]+$/i;
  const HOLE = "\u0000"; // placeholder delimiter; stripped from the input first

  function escapeHtml(text) {
    return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
  }

  // Inline markup of one escaped line.
  function inline(escaped) {
    const held = [];
    const hold = (html) => HOLE + (held.push(html) - 1) + HOLE;
    let s = escaped.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g,
                            (_, ticks, code) => hold("<code>" + code.trim() + "</code>"));
    // A URL may hold one level of balanced parentheses, as Wikipedia's do.
    s = s.replace(/\[([^\]]+)\]\(((?:[^()\s]|\([^()\s]*\))+)\)/g, (whole, text, url) => {
      if (!SAFE_URL.test(url)) return text;
      return hold('<a href="' + url + '" target="_blank" rel="noopener noreferrer">') + text + hold("</a>");
    });
    s = s.replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
         .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
         .replace(/\*(?=[^\s*])([^*]*?[^\s*])\*/g, "<em>$1</em>")
         .replace(/\*(?=[^\s*])([^*])\*/g, "<em>$1</em>")
         .replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_]|[^\s_])_(?!\w)/g, "$1<em>$2</em>")
         .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
    return s.replace(new RegExp(HOLE + "(\\d+)" + HOLE, "g"), (_, i) => held[Number(i)]);
  }

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const BULLET = /^\s*[-*+]\s+(.*)$/;
  const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
  const QUOTE = /^ {0,3}&gt;\s?(.*)$/;
  const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;

  function renderMarkdown(source) {
    const lines = escapeHtml(String(source).split(HOLE).join("")).replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let paragraph = [];
    const flush = () => {
      if (paragraph.length) out.push("<p>" + paragraph.map(inline).join("<br>") + "</p>");
      paragraph = [];
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      let m;
      if ((m = FENCE.exec(line))) {
        flush();
        const fence = m[1];
        const body = [];
        for (i++; i < lines.length && !(lines[i].trim().startsWith(fence[0].repeat(fence.length))
                                          && lines[i].trim().replace(/[`~]/g, "") === ""); i++) {
          body.push(lines[i]);
        }
        const lang = m[2] ? ' class="language-' + m[2] + '"' : "";
        out.push("<pre><code" + lang + ">" + body.join("\n") + "</code></pre>");
      } else if ((m = HEADING.exec(line))) {
        flush();
        const level = m[1].length;
        out.push("<h" + level + ">" + inline(m[2]) + "</h" + level + ">");
      } else if (RULE.test(line)) {
        flush();
        out.push("<hr>");
      } else if (BULLET.test(line) || NUMBERED.test(line)) {
        flush();
        const ordered = !BULLET.test(line);
        const pattern = ordered ? NUMBERED : BULLET;
        const start = ordered ? Number(NUMBERED.exec(line)[1]) : 1;
        const items = [];
        for (; i < lines.length && pattern.test(lines[i]); i++) {
          const item = pattern.exec(lines[i]);
          items.push("<li>" + inline(ordered ? item[2] : item[1]) + "</li>");
        }
        i--;
        const open = ordered ? (start !== 1 ? '<ol start="' + start + '">' : "<ol>") : "<ul>";
        out.push(open + items.join("") + (ordered ? "</ol>" : "</ul>"));
      } else if (QUOTE.test(line)) {
        flush();
        const quoted = [];
        for (; i < lines.length && QUOTE.test(lines[i]); i++) quoted.push(inline(QUOTE.exec(lines[i])[1]));
        i--;
        out.push("<blockquote>" + quoted.join("<br>") + "</blockquote>");
      } else if (line.trim() === "") {
        flush();
      } else {
        paragraph.push(line);
      }
    }
    flush();
    return out.join("\n");
  }

  const api = { renderMarkdown, escapeHtml };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  else root.PagodaMarkdown = api;
})(typeof window !== "undefined" ? window : globalThis);
