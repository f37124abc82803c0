// widget-view.js: what <corolla-chat> looks like: its CSS (themable through --corolla-*
// custom properties, see web/README.md) and its shadow root's markup. widget.js imports both
// and holds the behaviour.

export const STYLE = `
:host {
  --bg: var(--corolla-bg, #ffffff);
  --fg: var(--corolla-fg, #1d2027);
  --muted: var(--corolla-muted, #687080);
  --line: var(--corolla-line, #dde1e8);
  --panel: var(--corolla-panel, #f4f6f9);
  --accent: var(--corolla-accent, #c2416c);
  --accent-fg: var(--corolla-accent-fg, #ffffff);
  --bot: var(--corolla-bot, #eef0f4);
  --warn: var(--corolla-warn, #8a5a00);
  --danger: var(--corolla-danger, #b3261e);
  --danger-bg: var(--corolla-danger-bg, #fdecea);
  --ok: var(--corolla-ok, #1e8e3e);
  display: flex;
  flex-direction: column;
  box-sizing: border-box;
  min-height: 420px;
  min-width: 0;
  overflow: hidden;
  background: var(--bg);
  color: var(--fg);
  border: 1px solid var(--line);
  border-radius: 12px;
  font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
}
@media (prefers-color-scheme: dark) {
  :host {
    --bg: var(--corolla-bg, #16181d);
    --fg: var(--corolla-fg, #e6e8ec);
    --muted: var(--corolla-muted, #9aa1ad);
    --line: var(--corolla-line, #2c313a);
    --panel: var(--corolla-panel, #1d2027);
    --accent: var(--corolla-accent, #e0668f);
    --accent-fg: var(--corolla-accent-fg, #16181d);
    --bot: var(--corolla-bot, #242832);
    --warn: var(--corolla-warn, #e3b341);
    --danger: var(--corolla-danger, #ff8a80);
    --danger-bg: var(--corolla-danger-bg, #3a1d1d);
    --ok: var(--corolla-ok, #5cc97b);
  }
}
:host([hidden]) { display: none; }
*, *::before, *::after { box-sizing: border-box; }
[hidden] { display: none !important; }

header {
  display: flex; flex-wrap: nowrap; align-items: center; gap: 8px;
  padding: 10px 14px; border-bottom: 1px solid var(--line); background: var(--panel);
}
#new { flex: none; padding: 3px 10px; font-size: .8rem; }
.title { flex: 1 1 auto; min-width: 0; display: flex; align-items: baseline; gap: 8px; }
h2 { margin: 0; font-size: 1rem; font-weight: 650; white-space: nowrap; }
#model { color: var(--muted); font-size: .8rem; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
#status {
  display: inline-flex; align-items: center; gap: 6px; font-size: .8rem; color: var(--muted);
  flex: 0 1 auto; min-width: 0; overflow: hidden; white-space: nowrap; text-overflow: ellipsis;
}
#status::before {
  content: ""; width: 8px; height: 8px; border-radius: 50%; background: var(--warn);
}
:host([data-state="ready"]) #status::before { background: var(--ok); }
:host([data-state="generating"]) #status::before { background: var(--accent); }
:host([data-state="error"]) #status::before { background: var(--danger); }

#error {
  display: flex; align-items: flex-start; gap: 8px; margin: 8px 12px 0; padding: 8px 10px;
  border-radius: 8px; background: var(--danger-bg); color: var(--danger); font-size: .875rem;
}
#error .text { flex: 1; min-width: 0; overflow-wrap: anywhere; white-space: pre-wrap; }
#error button { flex: none; }

#progress { padding: 8px 14px 0; font-size: .8rem; color: var(--muted); }
#progress .label { overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
#progress progress { width: 100%; height: 8px; accent-color: var(--accent); }

#messages {
  flex: 1 1 auto; min-height: 0; overflow-y: auto; overscroll-behavior: contain;
  display: flex; flex-direction: column; gap: 10px; padding: 12px;
}
.hint { margin: auto; max-width: 32em; text-align: center; color: var(--muted); font-size: .875rem; }
.examples { display: flex; flex-wrap: wrap; justify-content: center; gap: 6px; margin-top: 10px; }
.examples button { font-size: .8rem; padding: 5px 10px; border-radius: 14px; }
.msg { display: flex; flex-direction: column; max-width: 88%; }
.msg.user { align-self: flex-end; align-items: flex-end; }
.msg.assistant { align-self: flex-start; }
.bubble {
  padding: 8px 12px; border-radius: 14px; white-space: pre-wrap; overflow-wrap: anywhere;
}
.assistant .bubble { white-space: normal; }
.bubble > :first-child { margin-top: 0; }
.bubble > :last-child { margin-bottom: 0; }
.bubble p, .bubble ul, .bubble ol { margin: .4em 0; }
.bubble ul, .bubble ol { padding-left: 1.4em; }
.bubble .h { font-weight: 650; margin: .6em 0 .3em; }
.bubble .h1, .bubble .h2 { font-size: 1.08em; }
.bubble code { font: .88em/1.4 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
  background: color-mix(in srgb, var(--fg) 9%, transparent); padding: 1px 4px; border-radius: 4px; }
.bubble a { color: inherit; }
.code { margin: .5em 0; border: 1px solid var(--line); border-radius: 8px; overflow: hidden; background: var(--bg); }
.code-bar { display: flex; justify-content: space-between; align-items: center; gap: 8px;
  padding: 3px 4px 3px 10px; font-size: .75rem; color: var(--muted); border-bottom: 1px solid var(--line); }
.code-bar .copy { padding: 1px 8px; font-size: .75rem; }
.code pre { margin: 0; padding: 8px 10px; overflow-x: auto; white-space: pre; }
.code pre code { background: none; padding: 0; }
.actions { display: flex; gap: 4px; margin-top: 2px; }
.actions button { padding: 1px 8px; font-size: .75rem; background: transparent; border-color: transparent; color: var(--muted); }
.actions button:hover:not(:disabled) { border-color: var(--line); color: var(--fg); }
.user .bubble { background: var(--accent); color: var(--accent-fg); border-bottom-right-radius: 4px; }
.assistant .bubble { background: var(--bot); border-bottom-left-radius: 4px; }
.streaming .bubble::after { content: "\\258D"; animation: blink 1s steps(1) infinite; opacity: .6; }
@keyframes blink { 50% { opacity: 0; } }
.failed .bubble { opacity: .55; }
.meta { margin-top: 3px; font-size: .75rem; color: var(--muted); overflow-wrap: anywhere; }
details.meta summary { cursor: pointer; list-style-position: inside; }
details.meta .route { margin-top: 2px; }
.notice { margin-top: 3px; font-size: .75rem; color: var(--warn); }
.failed .meta { color: var(--danger); }

#settings { border-top: 1px solid var(--line); padding: 6px 14px; font-size: .85rem; }
#settings summary { cursor: pointer; color: var(--muted); user-select: none; }
.fields { display: grid; grid-template-columns: repeat(auto-fit, minmax(96px, 1fr)); gap: 8px; padding: 8px 0 4px; }
.fields label { display: flex; flex-direction: column; gap: 2px; color: var(--muted); font-size: .75rem; }
.fields input {
  width: 100%; padding: 5px 6px; font: inherit; font-size: .875rem; color: var(--fg);
  background: var(--bg); border: 1px solid var(--line); border-radius: 6px;
}
.fields input[aria-invalid="true"] { border-color: var(--danger); }
#settings-msg { color: var(--danger); font-size: .8rem; }

form { display: flex; gap: 8px; padding: 10px 12px 12px; border-top: 1px solid var(--line); }
textarea {
  flex: 1 1 auto; min-width: 0; min-height: 44px; max-height: 160px; resize: none;
  padding: 8px 10px; font: inherit; color: var(--fg); background: var(--bg);
  border: 1px solid var(--line); border-radius: 10px;
}
textarea:focus, .fields input:focus { outline: 2px solid var(--accent); outline-offset: -1px; }
/* Send and Stop take turns in one place: nothing moves when an answer starts. */
.buttons { display: flex; align-items: stretch; }
.buttons button { min-width: 72px; }
button {
  font: inherit; font-size: .875rem; padding: 7px 14px; border-radius: 10px; cursor: pointer;
  border: 1px solid var(--line); background: var(--panel); color: var(--fg);
}
button:disabled { opacity: .5; cursor: not-allowed; }
#send { background: var(--accent); color: var(--accent-fg); border-color: var(--accent); font-weight: 600; }
#send:disabled { background: var(--panel); color: var(--muted); border-color: var(--line); opacity: 1; font-weight: 400; }
#error button { padding: 2px 8px; font-size: .8rem; background: transparent; color: inherit; border-color: currentColor; }
`;

export const TEMPLATE = `
<style>${STYLE}</style>
<header>
  <div class="title"><h2 id="heading"></h2><span id="model"></span></div>
  <span id="status" role="status" aria-live="polite"></span>
  <button type="button" id="new" title="Start a new conversation" disabled>New chat</button>
</header>
<div id="error" role="alert" hidden>
  <span class="text"></span>
  <button type="button" class="retry" hidden>Retry</button>
  <button type="button" class="dismiss" aria-label="Dismiss">×</button>
</div>
<div id="progress" hidden>
  <div class="label"></div>
  <progress max="1"></progress>
</div>
<div id="messages" role="log" aria-live="polite"></div>
<details id="settings">
  <summary>Settings</summary>
  <div class="fields">
    <label>Temperature<input id="temperature" type="number" min="0" max="2" step="0.1" inputmode="decimal"></label>
    <label>Top-p<input id="top-p" type="number" min="0" max="1" step="0.05" inputmode="decimal"></label>
    <label>Max new tokens<input id="max-new-tokens" type="number" min="1" max="2048" step="1" inputmode="numeric"></label>
  </div>
  <div id="settings-msg" role="alert"></div>
</details>
<form>
  <textarea id="input" rows="1" placeholder="Ask something…" aria-label="Message"></textarea>
  <div class="buttons">
    <button id="send" type="submit" disabled>Send</button>
    <button id="stop" type="button" hidden>Stop</button>
  </div>
</form>
`;
