// markdown.js: the Markdown subset <corolla-chat> renders answers in, built as DOM nodes so
// that model output never becomes HTML (see web/README.md).

// Renders the small Markdown subset models write (fenced code, inline code, bold, italics,
// headings, lists, http(s) links) as DOM nodes: model output never becomes HTML.
export function renderMarkdown(container, text) {
  container.replaceChildren();
  const fence = /^```([^\n`]*)\n?([\s\S]*?)(?:\n?```[^\n]*(?:\n|$)|$)/gm;
  let last = 0;
  for (const m of text.matchAll(fence)) {
    renderBlocks(container, text.slice(last, m.index));
    container.append(codeBlock(m[1].trim(), m[2]));
    last = m.index + m[0].length;
  }
  renderBlocks(container, text.slice(last));
}

function codeBlock(lang, code) {
  const box = document.createElement('div');
  box.className = 'code';
  const bar = document.createElement('div');
  bar.className = 'code-bar';
  const label = document.createElement('span');
  label.textContent = lang || 'code';
  const copy = document.createElement('button');
  copy.type = 'button';
  copy.className = 'copy';
  copy.textContent = 'Copy';
  copy.addEventListener('click', () => copyText(code).then(
    () => { copy.textContent = 'Copied'; setTimeout(() => { copy.textContent = 'Copy'; }, 1500); },
    () => { copy.textContent = 'Copy failed'; },
  ));
  bar.append(label, copy);
  const pre = document.createElement('pre');
  const codeEl = document.createElement('code');
  codeEl.textContent = code;
  pre.append(codeEl);
  box.append(bar, pre);
  return box;
}

// The Clipboard API exists only in secure contexts; elsewhere fall back to a selection.
async function copyText(text) {
  if (navigator.clipboard && globalThis.isSecureContext) return navigator.clipboard.writeText(text);
  const area = document.createElement('textarea');
  area.value = text;
  area.style.position = 'fixed';
  area.style.opacity = '0';
  document.body.append(area);
  area.select();
  const ok = document.execCommand('copy');
  area.remove();
  if (!ok) throw new Error('copy refused');
}

function renderBlocks(container, text) {
  const lines = text.split('\n');
  let list = null;
  let para = null;
  const endBlocks = () => { list = null; para = null; };
  for (const line of lines) {
    if (!line.trim()) { endBlocks(); continue; }
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    const bullet = /^\s*[-*+]\s+(.*)$/.exec(line);
    const numbered = /^\s*(\d{1,3})[.)]\s+(.*)$/.exec(line);
    if (heading) {
      endBlocks();
      const h = document.createElement('p');
      h.className = `h h${heading[1].length}`;
      renderInline(h, heading[2]);
      container.append(h);
    } else if (bullet || numbered) {
      const kind = bullet ? 'UL' : 'OL';
      if (!list || list.tagName !== kind) {
        para = null;
        list = document.createElement(kind.toLowerCase());
        if (numbered && numbered[1] !== '1') list.start = Number(numbered[1]);
        container.append(list);
      }
      const li = document.createElement('li');
      renderInline(li, bullet ? bullet[1] : numbered[2]);
      list.append(li);
    } else if (list && /^\s+\S/.test(line) && list.lastElementChild) {
      list.lastElementChild.append(' ');
      renderInline(list.lastElementChild, line.trim());
    } else {
      list = null;
      if (para) para.append(document.createElement('br'));
      else { para = document.createElement('p'); container.append(para); }
      renderInline(para, line);
    }
  }
}

function renderInline(parent, text) {
  const inline = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\s][^*\n]*\*|_[^_\s][^_\n]*_)|(\[[^\]\n]+\]\((https?:\/\/[^\s)]+)\))/g;
  let last = 0;
  for (const m of text.matchAll(inline)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    let el;
    if (m[1]) { el = document.createElement('code'); el.textContent = m[1].slice(1, -1); }
    else if (m[2]) { el = document.createElement('strong'); renderInline(el, m[2].slice(2, -2)); }
    else if (m[3]) { el = document.createElement('em'); renderInline(el, m[3].slice(1, -1)); }
    else {
      el = document.createElement('a');
      el.href = m[5];
      el.target = '_blank';
      el.rel = 'noopener noreferrer nofollow';
      el.textContent = m[4].slice(1, m[4].indexOf(']('));
    }
    parent.append(el);
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.append(text.slice(last));
}
