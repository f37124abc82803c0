// widget.js: the <corolla-chat> custom element, Corolla's browser chat UI.
//
// The element loads the WebAssembly client (corolla-wasm.js, which trunk builds into the same
// folder as this file), downloads the model's client part (tokenizer, embeddings, head) from a
// Corolla server, connects to the swarm over libp2p (WebRTC-direct or WebSocket) and streams
// answers into the page. Markup and CSS live in an open shadow root, so the element can be
// dropped into any page. Attributes, properties, events and the test hooks are documented in
// web/README.md.
//
// Over 600 lines because it is one custom element's behaviour, one class with private fields
// (a class cannot be split across modules); its look is widget-view.js, the Markdown renderer
// markdown.js. The helpers above the class (errors, addresses, the wasm loader) are the piece to
// move out next.

import { renderMarkdown } from './markdown.js';
import { TEMPLATE } from './widget-view.js';

export { renderMarkdown };

const WASM_JS = 'corolla-wasm.js';
const WASM_BIN = 'corolla-wasm_bg.wasm';
const CONNECT_ATTEMPTS = 3;
const CONNECT_RETRY_MS = 1000;
const DEFAULTS = { temperature: 0.7, topP: 0.9, maxNewTokens: 128, heading: 'Corolla chat' };
// Small models ramble at 0.7: lean toward the likeliest tokens (a fresh seed per answer still
// lets "Regenerate" give another answer).
const SMALL_MODEL_TEMPERATURE = 0.2;
const SMALL_MODEL_PARAMETERS = 2e9;
const EXAMPLES = ['What is the capital of France?', 'Write a haiku about the sea.',
  'Explain recursion in two sentences.'];
// While a conversation is on screen, its server sessions are kept open this often, for at most
// KEEP_ALIVE_FOR after the last answer (servers expire idle sessions after a few minutes).
const KEEP_ALIVE_EVERY_MS = 60_000;
const KEEP_ALIVE_FOR_MS = 30 * 60_000;
const TRANSPORTS = ['auto', 'webrtc-direct', 'websocket'];

const BASE = new URL('.', import.meta.url);

// The page trunk builds carries trunk's own loader, which initialises the same module. A second
// init while that one is in flight would make a second instance and swap it in under objects of
// the first, so let trunk's finish first (after which wasm-bindgen's init returns at once).
function trunkLoaderDone() {
  if (globalThis.wasmBindings) return Promise.resolve();
  const loader = [...document.querySelectorAll('script[type="module"]:not([src])')]
    .find((s) => s.textContent.includes('TrunkApplicationStarted'));
  if (!loader) return Promise.resolve();
  return new Promise((resolve) => {
    addEventListener('TrunkApplicationStarted', () => resolve(), { once: true });
    setTimeout(resolve, 20000); // trunk's loader failed: our own init will say why
  });
}

// One WebAssembly instance per page, however many widgets there are.
let wasmPromise = null;
function loadWasm() {
  if (!wasmPromise) {
    wasmPromise = (async () => {
      const mod = await import(new URL(WASM_JS, BASE).href);
      await trunkLoaderDone();
      await mod.default({ module_or_path: new URL(WASM_BIN, BASE) });
      return mod;
    })();
    // A failed load (offline, missing file) must not poison a later retry.
    wasmPromise.catch(() => { wasmPromise = null; });
  }
  return wasmPromise;
}

// wasm-bindgen may reject with an Error, a plain string or any other JsValue.
function errorMessage(e) {
  if (e instanceof Error) return e.message || String(e);
  if (typeof e === 'string') return e;
  if (typeof e?.message === 'string') return e.message;
  try { return JSON.stringify(e); } catch { return String(e); }
}

// The kind of a failure (the client's `kind` words: no_coverage, busy, unreachable, …).
function errorKind(e) {
  if (typeof e?.kind === 'string') return e.kind;
  return e instanceof ConfigError ? 'bad_request' : 'internal';
}

// What the banner says failed, by the failure's kind.
const STAGE_OF_KIND = {
  no_coverage: 'No route',
  model_mismatch: 'No route',
  busy: 'Servers busy',
  unreachable: 'Servers unreachable',
  shutting_down: 'Servers unreachable',
  bad_server: 'A server answered wrongly',
  bad_request: 'Bad request',
  context_length_exceeded: 'Too long',
};

// An error worth showing as is, prefixed with the stage that failed.
class StageError extends Error {
  constructor(stage, cause) {
    super(`${stage}: ${errorMessage(cause)}`);
    this.kind = errorKind(cause);
    this.retryable = !(cause instanceof ConfigError);
  }
}
// A mistake in the element's configuration: retrying cannot help.
class ConfigError extends Error {}

// Keeps the multiaddrs the chosen transport can dial. Components are compared whole, so
// `/wss` is not mistaken for `/ws` and `/tls/ws` is recognised as secure.
export function filterAddresses(addrs, transport, pageIsHttps) {
  return addrs.filter((addr) => {
    const parts = new Set(addr.split('/'));
    const webrtc = parts.has('webrtc-direct');
    const plainWs = parts.has('ws') && !parts.has('tls');
    switch (transport) {
      case 'webrtc-direct': return webrtc;
      case 'websocket': return !webrtc && (parts.has('ws') || parts.has('wss'));
      // An https page may not open an insecure WebSocket (mixed content), so don't try.
      default: return !(pageIsHttps && plainWs);
    }
  });
}

// All peer ids start with the same "12D3KooW"; the tail tells them apart.
function shortId(peerId) {
  const id = String(peerId ?? '');
  return id.length > 8 ? id.slice(-6) : id;
}

const mb = (bytes) => (bytes / (1024 * 1024)).toFixed(1);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function parseNumber(value) {
  const s = String(value ?? '').trim();
  return s === '' ? NaN : Number(s);
}

export class CorollaChat extends HTMLElement {
  static observedAttributes = ['heading'];

  #state = 'loading';
  #client = null;
  #lastResult = null;
  #lastError = null;
  #started = false;
  // User and assistant turns ({role, content, el}); the system prompt is prepended per request.
  #turns = [];
  #config = null;
  #statusAddresses = null;
  #temperatureTouched = false;
  #lastActivity = 0;
  #keepAlive = null;

  constructor() {
    super();
    this.attachShadow({ mode: 'open' }).innerHTML = TEMPLATE; // static markup; model output is only ever set as text

    this.#q('form').addEventListener('submit', (e) => { e.preventDefault(); this.#send(); });
    this.#q('#input').addEventListener('keydown', (e) => {
      if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) { e.preventDefault(); this.#send(); }
    });
    this.#q('#input').addEventListener('input', () => this.#fitInput());
    this.#q('#stop').addEventListener('click', () => this.stop());
    this.#q('#new').addEventListener('click', () => this.newConversation());
    this.#q('#temperature').addEventListener('input', () => { this.#temperatureTouched = true; });
    this.#q('#error .dismiss').addEventListener('click', () => { this.#q('#error').hidden = true; });
    this.#q('#error .retry').addEventListener('click', () => this.#start());
    for (const id of ['#temperature', '#top-p', '#max-new-tokens']) {
      this.#q(id).addEventListener('input', () => this.#readSettings(false));
    }
  }

  #q(selector) { return this.shadowRoot.querySelector(selector); }

  get state() { return this.#state; }
  get lastResult() { return this.#lastResult; }
  get lastError() { return this.#lastError; }
  get client() { return this.#client; }

  connectedCallback() {
    this.#renderHeading();
    if (this.#started) return;
    this.#started = true;
    this.#setState('loading');
    // A microtask later, so attributes set right after the element is appended are still seen.
    queueMicrotask(() => {
      const config = this.#readConfig();
      this.#q('#temperature').value = config.temperature;
      this.#q('#top-p').value = config.topP;
      this.#q('#max-new-tokens').value = config.maxNewTokens;
      this.#start();
    });
  }

  disconnectedCallback() {
    if (this.#state === 'generating') this.#client?.stop();
    clearInterval(this.#keepAlive);
    this.#keepAlive = null;
  }

  attributeChangedCallback() { this.#renderHeading(); }

  #renderHeading() {
    this.#q('#heading').textContent = this.getAttribute('heading') || DEFAULTS.heading;
  }

  #readConfig() {
    const attr = (name) => {
      const v = this.getAttribute(name);
      return v === null || v.trim() === '' ? null : v.trim();
    };
    const num = (name, fallback) => {
      const v = parseNumber(attr(name));
      return Number.isFinite(v) ? v : fallback;
    };
    const seed = parseNumber(attr('seed'));
    return {
      server: (attr('server') || new URL(import.meta.url).origin).replace(/\/+$/, ''),
      bootstrap: attr('bootstrap')?.split(/[\s,]+/).filter(Boolean) ?? null,
      transport: (attr('transport') || 'auto').toLowerCase(),
      system: this.getAttribute('system') || null,
      temperature: num('temperature', DEFAULTS.temperature),
      topP: num('top-p', DEFAULTS.topP),
      maxNewTokens: num('max-new-tokens', DEFAULTS.maxNewTokens),
      temperatureGiven: attr('temperature') !== null,
      seed: Number.isSafeInteger(seed) && seed >= 0 ? seed : null,
      adapter: attr('adapter'),
      examples: attr('examples')?.split('|').map((e) => e.trim()).filter(Boolean) ?? EXAMPLES,
      persist: attr('persist') !== 'false',
    };
  }

  #setState(state) {
    this.#state = state;
    this.setAttribute('data-state', state);
    const generating = state === 'generating';
    this.#q('#send').disabled = state !== 'ready';
    this.#q('#send').hidden = generating;
    this.#q('#stop').hidden = !generating;
    this.#q('#new').disabled = state !== 'ready' || this.#turns.length === 0;
    for (const b of this.shadowRoot.querySelectorAll('.actions button, .examples button')) {
      b.disabled = state !== 'ready';
    }
    this.#q('#stop').disabled = false;
    this.#q('#stop').textContent = 'Stop';
    if (state === 'ready') this.#setStatus('ready');
    else if (generating) this.#setStatus('answering…');
    else if (state === 'error') this.#setStatus('error');
  }

  #setStatus(text) { this.#q('#status').textContent = text; }

  #emit(name, detail) {
    this.dispatchEvent(new CustomEvent(name, { detail, bubbles: true, composed: true }));
  }

  #showError(message, retryable) {
    this.#q('#error .text').textContent = message;
    this.#q('#error .retry').hidden = !retryable;
    this.#q('#error').hidden = false;
  }

  // Records, shows and announces an error. Startup errors leave the element in "error".
  #fail(message, { fatal, retryable = false, kind = 'internal' }) {
    this.#lastError = message;
    if (fatal) this.#setState('error');
    this.#showError(message, fatal && retryable);
    this.#emit('corolla-error', { message, kind });
  }

  // Load the model's client part, then join the swarm. Also the Retry button's action.
  async #start() {
    if (this.#state !== 'loading' && this.#state !== 'error') return;
    // Re-read on every try: a retry should honour changed attributes and fresh server addresses.
    this.#config = this.#readConfig();
    this.#statusAddresses = null;
    this.#lastError = null;
    this.#q('#error').hidden = true;
    this.#showEmpty();
    try {
      if (!this.#client) {
        this.#setState('loading');
        this.#setStatus('loading model…');
        let mod;
        try { mod = await loadWasm(); }
        catch (e) { throw new StageError('Could not load the WebAssembly client', e); }
        // Marks on the page's timeline, for profilers and the tests' long-task figures.
        performance.mark('corolla-wasm-loaded');
        try {
          this.#client = await mod.CorollaClient.load(this.#config.server, (p) => this.#showProgress(p));
        } catch (e) {
          throw new StageError('Model download failed', e);
        } finally {
          this.#q('#progress').hidden = true;
        }
        performance.mark('corolla-model-loaded');
        const info = this.#client.info();
        this.#q('#model').textContent = info.model;
        this.#q('#model').title = `${info.model}: ${info.num_layers} blocks, ` +
          `hidden size ${info.hidden_size}, vocabulary ${info.vocab_size}, context ${info.max_positions}`;
        const parameters = 12 * info.num_layers * info.hidden_size ** 2 + 2 * info.vocab_size * info.hidden_size;
        if (!this.#config.temperatureGiven && !this.#temperatureTouched && parameters < SMALL_MODEL_PARAMETERS) {
          this.#q('#temperature').value = SMALL_MODEL_TEMPERATURE;
        }
        this.#restore();
      }
      this.#setState('connecting');
      let addresses;
      try { addresses = await this.#connect(); }
      catch (e) { throw new StageError('Cannot connect', e); }
      performance.mark('corolla-connected');
      this.#setState('ready');
      this.#startKeepAlive();
      this.#emit('corolla-ready', { model: this.#client.info().model, addresses });
    } catch (e) {
      this.#fail(errorMessage(e), { fatal: true, retryable: e.retryable !== false, kind: errorKind(e) });
    }
  }

  #showProgress(p) {
    const { file = '', loaded = 0, total = 0, cached = false } = p ?? {};
    const box = this.#q('#progress');
    const bar = box.querySelector('progress');
    box.hidden = false;
    this.#setStatus(cached ? 'loading model…' : 'downloading model…');
    if (total > 0) {
      bar.max = total;
      bar.value = Math.min(loaded, total);
    } else {
      bar.removeAttribute('value'); // indeterminate: the server sent no length
    }
    const amount = total > 0 ? `${mb(loaded)} / ${mb(total)} MB` : `${mb(loaded)} MB`;
    box.querySelector('.label').textContent = `${file}: ${amount}${cached ? ' (from cache)' : ''}`;
  }

  async #connect() {
    let lastError;
    for (let attempt = 1; attempt <= CONNECT_ATTEMPTS; attempt++) {
      this.#setStatus(`connecting (attempt ${attempt}/${CONNECT_ATTEMPTS})`);
      try {
        const addresses = await this.#bootstrapAddresses();
        await this.#client.connect(addresses);
        return addresses;
      } catch (e) {
        if (e instanceof ConfigError) throw e;
        lastError = e;
        if (attempt < CONNECT_ATTEMPTS) await sleep(CONNECT_RETRY_MS);
      }
    }
    throw new Error(`${errorMessage(lastError)} (${CONNECT_ATTEMPTS} attempts)`);
  }

  async #bootstrapAddresses() {
    const { transport, server } = this.#config;
    if (!TRANSPORTS.includes(transport)) {
      throw new ConfigError(`unknown transport "${transport}" (use ${TRANSPORTS.join(', ')})`);
    }
    let all = this.#config.bootstrap;
    let source = 'the bootstrap attribute';
    if (!all) {
      source = `${server}/api/status`;
      if (!this.#statusAddresses) {
        let status;
        try {
          const response = await fetch(`${server}/api/status`, { cache: 'no-store' });
          if (!response.ok) throw new Error(`HTTP ${response.status}`);
          status = await response.json();
        } catch (e) {
          throw new Error(`cannot read ${source}: ${errorMessage(e)}`);
        }
        this.#statusAddresses = Array.isArray(status.browser_addresses) ? status.browser_addresses : [];
      }
      all = this.#statusAddresses;
    }
    if (all.length === 0) throw new ConfigError(`${source} lists no addresses a browser can dial`);
    const picked = filterAddresses(all, transport, location.protocol === 'https:');
    if (picked.length === 0) {
      const why = transport === 'auto'
        ? 'only plain ws addresses, which an https page may not use'
        : `no ${transport} address`;
      throw new ConfigError(`${source} has ${why}: ${all.join(' ')}`);
    }
    return picked;
  }

  // Validates the settings panel. Throws (with the message shown) only when asked to.
  #readSettings(strict = true) {
    const fields = {
      temperature: this.#q('#temperature'),
      topP: this.#q('#top-p'),
      maxNewTokens: this.#q('#max-new-tokens'),
    };
    const t = parseNumber(fields.temperature.value);
    const p = parseNumber(fields.topP.value);
    const n = parseNumber(fields.maxNewTokens.value);
    const problems = [];
    const check = (input, ok, text) => {
      input.setAttribute('aria-invalid', String(!ok));
      if (!ok) problems.push(text);
    };
    check(fields.temperature, t >= 0 && t <= 2, 'Temperature must be a number from 0 to 2 (0 = always the likeliest token).');
    check(fields.topP, p >= 0 && p <= 1, 'Top-p must be a number from 0 to 1.');
    check(fields.maxNewTokens, Number.isInteger(n) && n >= 1 && n <= 2048, 'Max new tokens must be a whole number from 1 to 2048.');
    this.#q('#settings-msg').textContent = problems.join(' ');
    if (problems.length && strict) {
      this.#q('#settings').open = true;
      throw new Error(problems.join(' '));
    }
    const settings = { temperature: t, top_p: p, max_new_tokens: n };
    if (this.#config?.seed != null) settings.seed = this.#config.seed;
    if (this.#config?.adapter) settings.adapter = this.#config.adapter;
    return settings;
  }

  #send() {
    if (this.#state !== 'ready') return;
    const input = this.#q('#input');
    const text = input.value;
    if (!text.trim()) return;
    try { this.#readSettings(); } catch { return; } // keep the text; the panel says what to fix
    input.value = '';
    this.#fitInput();
    this.ask(text).catch(() => {}); // the error is already shown in the banner
  }

  /** Sends `text` as the next user turn; resolves with the Result, rejects with an Error. */
  async ask(text) {
    text = String(text ?? '').trim();
    if (!text) throw new Error('Type a message first.');
    this.#checkReady();
    const settings = this.#settingsOrShow();
    const userTurn = { role: 'user', content: text };
    this.#turns.push(userTurn);
    userTurn.el = this.#addMessage(userTurn);
    return this.#answer(settings, userTurn);
  }

  /** Asks again for the last answer (a fresh seed: another answer when sampling). */
  async regenerate() {
    this.#checkReady();
    const last = this.#turns.at(-1);
    if (last?.role !== 'assistant') throw new Error('There is no answer to regenerate.');
    const settings = this.#settingsOrShow();
    this.#turns.pop();
    last.el.remove();
    return this.#answer(settings, this.#turns.at(-1));
  }

  /** Takes the user message at `index` (of `conversation`) and everything after it off the
   *  conversation, and puts its text into the input to be edited and sent again. */
  edit(index) {
    this.#checkReady();
    const turn = this.#turns[index];
    if (turn?.role !== 'user') throw new Error('Only your own messages can be edited.');
    for (const t of this.#turns.splice(index)) t.el.remove();
    const input = this.#q('#input');
    input.value = turn.content;
    this.#fitInput();
    input.focus();
    this.#save();
    this.#showEmpty();
    this.#setState('ready');
  }

  /** Forgets the conversation (on screen, in storage and on the servers). */
  newConversation() {
    this.#checkReady();
    for (const t of this.#turns) t.el.remove();
    this.#turns = [];
    this.#save();
    this.#showEmpty();
    this.#setState('ready');
    this.#client?.reset().catch(() => {});
  }

  /** The conversation so far: [{role, content}] (without the system prompt). */
  get conversation() { return this.#turns.map(({ role, content }) => ({ role, content })); }

  #checkReady() {
    if (this.#state !== 'ready') {
      throw new Error(this.#state === 'generating'
        ? 'Still answering; stop it or wait for the answer.'
        : `Not ready (${this.#state}).`);
    }
  }

  #settingsOrShow() {
    try { return this.#readSettings(); }
    catch (e) { this.#lastError = e.message; this.#showError(e.message, false); throw e; }
  }

  // Answers the conversation as it stands; `userTurn` is the turn being answered, dropped
  // again (with its message) if no answer comes.
  async #answer(settings, userTurn) {
    this.#lastError = null;
    this.#q('#error').hidden = true;
    this.#setState('generating'); // synchronously, so a second Enter can't start a second chat
    const messages = this.conversation;
    if (this.#config.system) messages.unshift({ role: 'system', content: this.#config.system });
    const botTurn = { role: 'assistant', content: '' };
    const botEl = this.#addMessage(botTurn);
    botEl.classList.add('streaming');
    const bubble = botEl.querySelector('.bubble');
    let text = '';
    let count = 0;
    let frame = 0;
    const render = () => { frame = 0; renderMarkdown(bubble, text); };
    try {
      const result = await this.#client.chat(messages, settings, (piece, tokenId, shown) => {
        // `shown` is the whole answer so far: shorter than before when
        // tokens were withdrawn (a server caught lying earlier in the answer).
        if (tokenId !== undefined) count += 1;
        text = shown;
        const follow = this.#atBottom();
        if (!frame) frame = requestAnimationFrame(() => { render(); if (follow) this.#scrollToBottom(); });
        this.#emit('corolla-token', { piece, tokenId, count, text });
      });
      if (frame) cancelAnimationFrame(frame);
      const follow = this.#atBottom();
      if (typeof result.text === 'string') text = result.text;
      render();
      // Cancelled answers stay in the conversation too: the model did say that much.
      botTurn.content = text;
      botTurn.el = botEl;
      this.#turns.push(botTurn);
      this.#addMeta(botEl, result);
      this.#addActions();
      if (follow) this.#scrollToBottom();
      this.#lastResult = result;
      this.#lastActivity = Date.now();
      this.#save();
      this.#setState('ready');
      this.#emit('corolla-answer', result);
      return result;
    } catch (e) {
      if (frame) cancelAnimationFrame(frame);
      const message = errorMessage(e);
      // A question that never got an answer would confuse the next request: drop it.
      const i = this.#turns.lastIndexOf(userTurn);
      if (i >= 0 && userTurn.role === 'user' && i === this.#turns.length - 1) {
        this.#turns.splice(i, 1);
        userTurn.el?.classList.add('failed');
      }
      botEl.classList.add('failed');
      if (!text) bubble.textContent = '(no answer)';
      this.#addLine(botEl, 'meta', 'Failed; this turn is left out of the conversation.');
      this.#addActions();
      this.#setState('ready'); // before the event, so listeners may ask again at once
      const kind = errorKind(e);
      const stage = STAGE_OF_KIND[kind] ?? 'Answer failed';
      this.#fail(`${stage}: ${message}`, { fatal: false, kind });
      throw Object.assign(new Error(message), { kind, retryable: e?.retryable ?? false });
    } finally {
      botEl.classList.remove('streaming');
    }
  }

  /** Ends the running answer early; it resolves with stop_reason "cancelled". */
  stop() {
    if (this.#state !== 'generating') return;
    this.#q('#stop').disabled = true;
    this.#q('#stop').textContent = 'Stopping…';
    this.#client?.stop();
  }

  // The conversation survives reloads, per server, model and system prompt.
  #storageKey() {
    const model = this.#client?.info().model ?? '';
    return `corolla-chat:${this.#config.server}:${model}:${this.#config.system ?? ''}`;
  }

  #save() {
    if (!this.#config?.persist) return;
    try {
      const turns = this.conversation;
      if (turns.length) localStorage.setItem(this.#storageKey(), JSON.stringify({ turns }));
      else localStorage.removeItem(this.#storageKey());
    } catch { /* storage full or blocked: the conversation just isn't kept */ }
  }

  #restore() {
    let turns = [];
    if (this.#config.persist) {
      try { turns = JSON.parse(localStorage.getItem(this.#storageKey()) ?? '{}').turns ?? []; }
      catch { turns = []; }
    }
    for (const t of this.#turns) t.el.remove();
    this.#turns = turns
      .filter((t) => (t.role === 'user' || t.role === 'assistant') && typeof t.content === 'string')
      .map(({ role, content }) => ({ role, content }));
    for (const t of this.#turns) t.el = this.#addMessage(t);
    this.#addActions();
    this.#showEmpty();
  }

  // Example prompts (and what Corolla is) while the conversation is empty.
  #showEmpty() {
    const list = this.#q('#messages');
    list.querySelector('.hint')?.remove();
    if (this.#turns.length) return;
    const hint = document.createElement('div');
    hint.className = 'hint';
    hint.append('Answers are computed by a swarm of Corolla servers, each running a slice of the ' +
      'model; your browser runs the rest.');
    const examples = document.createElement('div');
    examples.className = 'examples';
    for (const example of this.#config.examples) {
      const b = document.createElement('button');
      b.type = 'button';
      b.textContent = example;
      b.disabled = this.#state !== 'ready';
      b.addEventListener('click', () => this.ask(example).catch(() => {}));
      examples.append(b);
    }
    hint.append(examples);
    list.append(hint);
  }

  #addMessage(turn) {
    this.#q('#messages .hint')?.remove();
    const el = document.createElement('div');
    el.className = `msg ${turn.role}`;
    const bubble = document.createElement('div');
    bubble.className = 'bubble';
    if (turn.role === 'assistant') renderMarkdown(bubble, turn.content);
    else bubble.textContent = turn.content;
    el.append(bubble);
    this.#q('#messages').append(el);
    this.#scrollToBottom();
    return el;
  }

  // Edit on every user message, Regenerate on the last answer.
  #addActions() {
    for (const old of this.shadowRoot.querySelectorAll('.actions')) old.remove();
    this.#turns.forEach((turn, index) => {
      const last = index === this.#turns.length - 1;
      if (turn.role === 'assistant' && !last) return;
      const row = document.createElement('div');
      row.className = 'actions';
      const b = document.createElement('button');
      b.type = 'button';
      b.className = turn.role === 'user' ? 'edit' : 'regenerate';
      b.textContent = turn.role === 'user' ? 'Edit' : 'Regenerate';
      b.disabled = this.#state !== 'ready';
      b.addEventListener('click', () => {
        try {
          if (turn.role === 'user') this.edit(this.#turns.indexOf(turn));
          else this.regenerate().catch(() => {});
        } catch (e) { this.#showError(errorMessage(e), false); }
      });
      row.append(b);
      turn.el.append(row);
    });
  }

  #addLine(parent, cls, text) {
    const line = document.createElement('div');
    line.className = cls;
    line.textContent = text;
    parent.append(line);
    return line;
  }

  // Tokens and speed in a line; which servers answered behind a toggle.
  #addMeta(botEl, result) {
    const tokens = result.generated_ids?.length ?? 0;
    const speed = Number(result.tokens_per_second) || 0;
    const meta = document.createElement('details');
    meta.className = 'meta';
    const summary = document.createElement('summary');
    summary.textContent = `${tokens} tokens · ${speed.toFixed(1)} tokens/s` +
      (result.stop_reason === 'cancelled' ? ' · stopped' : '');
    meta.append(summary);
    const route = result.route ?? [];
    if (route.length) {
      const line = document.createElement('div');
      line.className = 'route';
      line.append(`${route.length} server${route.length > 1 ? 's' : ''}: `);
      route.forEach((hop, i) => {
        if (i) line.append(', ');
        const span = document.createElement('span');
        span.textContent = `${shortId(hop.peer_id)} (blocks ${hop.start}..${hop.end})`;
        span.title = hop.peer_id;
        line.append(span);
      });
      meta.append(line);
    }
    if (result.reused_tokens > 0) {
      this.#addLine(meta, 'route', `${result.reused_tokens} of ${result.prompt_ids?.length ?? 0} prompt tokens were already on the servers`);
    }
    botEl.append(meta);
    for (const r of result.recoveries ?? []) {
      const seconds = (Number(r.seconds) || 0).toFixed(1);
      const line = this.#addLine(botEl, 'notice', `a server was lost; recovered in ${seconds}s`);
      line.title = `${r.failed_peer} (blocks ${r.start}..${r.end}) failed at token ${r.step}: ${r.error}`;
    }
    const suspects = result.suspects ?? [];
    if (suspects.length) {
      const line = this.#addLine(botEl, 'notice',
        `spot checks caught ${suspects.length === 1 ? 'a server' : `${suspects.length} servers`} returning wrong results; the answer used honest servers`);
      line.title = suspects.join(', ');
    }
  }

  // Servers expire idle sessions: while the conversation is on screen (and was used in the last
  // half hour), keep its sessions open so that the next turn sends only its new tokens.
  #startKeepAlive() {
    if (this.#keepAlive) return;
    this.#keepAlive = setInterval(() => {
      const recent = Date.now() - this.#lastActivity < KEEP_ALIVE_FOR_MS;
      if (this.#state === 'ready' && this.#turns.length && recent && document.visibilityState === 'visible') {
        this.#client?.keepAlive().catch(() => {});
      }
    }, KEEP_ALIVE_EVERY_MS);
  }

  #atBottom() {
    const list = this.#q('#messages');
    return list.scrollHeight - list.scrollTop - list.clientHeight < 48;
  }

  #scrollToBottom() {
    const list = this.#q('#messages');
    list.scrollTop = list.scrollHeight;
  }

  // Let the textarea grow with its text, up to the CSS max-height.
  #fitInput() {
    const input = this.#q('#input');
    input.style.height = 'auto';
    input.style.height = `${input.scrollHeight + 2}px`;
  }
}

if (!customElements.get('corolla-chat')) customElements.define('corolla-chat', CorollaChat);
