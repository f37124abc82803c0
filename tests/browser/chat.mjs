// Drives Corolla's web chat (or the widget demo page) in Debian's headless
// Chromium: waits until the page has loaded the model and joined the swarm,
// sets greedy sampling, sends prompts through the real UI, and prints one
// JSON line per event on stdout (`ready`, `token` for the first token of
// each answer, `answer`, `error`), so a Rust test can act mid-answer (kill
// a server) and compare the answers with `corolla generate`.
//
// node chat.mjs --url URL --prompt TEXT [--prompt TEXT...] [--max-new-tokens N]
//               [--temperature T] [--screenshot PNG] [--timeout-s S]
//               [--stop-after-tokens N] [--viewport WxH] [--reload-check]
//               [--measure] [--warm-rerun]

import { chromium } from 'playwright-core';
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseArgs } from 'node:util';

const { values: args } = parseArgs({
  options: {
    url: { type: 'string' },
    prompt: { type: 'string', multiple: true },
    'max-new-tokens': { type: 'string', default: '32' },
    temperature: { type: 'string', default: '0' },
    screenshot: { type: 'string' },
    'timeout-s': { type: 'string', default: '240' },
    // Click Stop once the last prompt's answer has this many tokens.
    'stop-after-tokens': { type: 'string' },
    viewport: { type: 'string', default: '1000x900' },
    // After the answers, reload the page and count the model files it fetches again.
    'reload-check': { type: 'boolean', default: false },
    chromium: { type: 'string', default: process.env.CHROMIUM || '/usr/bin/chromium' },
    // Console errors matching this pattern are expected (a test that kills a
    // server may see the browser log the dropped connection); any other
    // console error or uncaught page error fails the run.
    'allow-console-error': { type: 'string' },
    // After the answers: Markdown rendering, Regenerate, Edit, a reload that restores the
    // conversation, New chat, and a dark-mode screenshot (ui-dark.png beside --screenshot).
    'ui-check': { type: 'boolean', default: false },
    // Time to ready and to the first token, the client's traffic at its first token, the
    // renderer's peak resident memory (/proc) and the wasm memory's size.
    measure: { type: 'boolean', default: false },
    // After the answers: reload (the Cache API holds the client part on https), start a new
    // chat, send the first prompt again and measure the warm page the same way.
    'warm-rerun': { type: 'boolean', default: false },
  },
});
if (!args.url || !args.prompt) {
  console.error('usage: node chat.mjs --url URL --prompt TEXT [--prompt TEXT...]');
  process.exit(2);
}
const timeout = Number(args['timeout-s']) * 1000;
const [width, height] = args.viewport.split('x').map(Number);
const emit = (event) => console.log(JSON.stringify(event));

// A namespace's veth that has just come up can make Chromium abort a navigation with
// ERR_NETWORK_CHANGED; that is the test machine settling, not the page failing: try again.
async function navigate(go) {
  for (let attempt = 1; ; attempt++) {
    try {
      return await go();
    } catch (e) {
      if (attempt >= 3 || !String(e?.message).includes('ERR_NETWORK_CHANGED')) throw e;
      console.error(`[chat.mjs] ${e.message.split('\n')[0]}; navigating again`);
      await new Promise((resolve) => setTimeout(resolve, 1000));
    }
  }
}

// This run's renderer processes (descendants of the browser started on `profile`):
// pid and /proc status fields.
function renderers(profile) {
  const procs = new Map();
  for (const pid of readdirSync('/proc').filter((d) => /^\d+$/.test(d))) {
    try {
      const status = readFileSync(`/proc/${pid}/status`, 'utf8');
      const cmd = readFileSync(`/proc/${pid}/cmdline`, 'utf8');
      procs.set(pid, { cmd, ppid: String(statusField(status, 'PPid')), status });
    } catch {
      // The process ended while we looked.
    }
  }
  const ours = (pid) => {
    for (let p = pid, depth = 0; p && procs.has(p) && depth < 8; p = procs.get(p).ppid, depth++) {
      if (procs.get(p).cmd.includes(profile)) return true;
    }
    return false;
  };
  return [...procs].filter(([pid, p]) => p.cmd.includes('--type=renderer') && ours(pid))
    .map(([pid, p]) => ({ pid, status: p.status }));
}

const statusField = (status, key) => Number((status.match(new RegExp(`${key}:\\s+(\\d+)`)) ?? [0, 0])[1]);

// A renderer's private resident memory in bytes: its anonymous and shared-memory pages,
// what the page itself holds (wasm memories, JavaScript heaps, compiled code, buffers).
// The rest of its RSS is Chromium's own binary mapped from disk (~120 MB), the same
// pages in every Chromium process; Chrome's task manager leaves it out of a tab's
// memory footprint too.
const privateBytes = (status) => (statusField(status, 'RssAnon') + statusField(status, 'RssShmem')) * 1024;

// The resident memory of this run's renderers, in bytes: the largest peak (VmHWM) and
// current (VmRSS), and the private part now (see `privateBytes`).
function rendererMemory(profile) {
  let peak = 0;
  let now = 0;
  let privateNow = 0;
  let largest = null;
  for (const { pid, status } of renderers(profile)) {
    peak = Math.max(peak, statusField(status, 'VmHWM') * 1024);
    const rss = statusField(status, 'VmRSS') * 1024;
    if (rss >= now) largest = pid;
    now = Math.max(now, rss);
    privateNow = Math.max(privateNow, privateBytes(status));
  }
  return {
    renderer_peak_rss_bytes: peak,
    renderer_rss_bytes: now,
    renderer_private_bytes: privateNow,
    renderer_breakdown: residentBreakdown(largest),
  };
}

// The renderers' private memory sampled every 100 ms (VmHWM has no private
// counterpart): `take()` gives its peak since the last take.
class PrivateMemoryWatch {
  constructor(profile) {
    this.profile = profile;
    this.pids = [];
    this.scanAt = 0;
    this.peak = 0;
    this.started = Date.now();
    // [ms since the watch started, MB] every 100 ms, for the figures' file.
    this.series = [];
    this.marks = {};
    this.timer = setInterval(() => this.sample(), 100);
  }

  sample() {
    if (Date.now() >= this.scanAt) {
      this.pids = renderers(this.profile).map((r) => r.pid);
      this.scanAt = Date.now() + 1000;
    }
    let now = 0;
    for (const pid of this.pids) {
      try {
        now = Math.max(now, privateBytes(readFileSync(`/proc/${pid}/status`, 'utf8')));
      } catch {
        this.scanAt = 0;
      }
    }
    this.peak = Math.max(this.peak, now);
    this.series.push([Date.now() - this.started, Math.round(now / 1e5) / 10]);
  }

  mark(name) {
    this.marks[name] = Date.now() - this.started;
  }

  take() {
    this.sample();
    const peak = this.peak;
    this.peak = 0;
    return peak;
  }

  stop() {
    clearInterval(this.timer);
  }
}

// Where a process's resident memory is: anonymous, file-backed (shared code and
// fonts, counted by RSS though no page owns them) and shared memory (from
// /proc/PID/status), and its largest mappings (/proc/PID/smaps), in MB.
function residentBreakdown(pid) {
  if (!pid) return null;
  try {
    const status = readFileSync(`/proc/${pid}/status`, 'utf8');
    const mappings = [];
    let current = null;
    for (const line of readFileSync(`/proc/${pid}/smaps`, 'utf8').split('\n')) {
      const head = line.match(/^([0-9a-f]+)-([0-9a-f]+)\s+(\S+)\s+\S+\s+\S+\s+\S+\s*(.*)$/);
      if (head) {
        current = {
          name: head[4] || '[anon]',
          size_mb: (parseInt(head[2], 16) - parseInt(head[1], 16)) / 1048576,
          perms: head[3],
          rss_mb: 0,
        };
        mappings.push(current);
      } else if (current && line.startsWith('Rss:')) {
        current.rss_mb = Number(line.split(/\s+/)[1]) / 1024;
      }
    }
    const anonByPerms = {};
    for (const m of mappings.filter((m) => m.name === '[anon]')) {
      anonByPerms[m.perms] = Math.round(((anonByPerms[m.perms] ?? 0) + m.rss_mb) * 10) / 10;
    }
    const byName = {};
    for (const m of mappings) byName[m.name] = (byName[m.name] ?? 0) + m.rss_mb;
    const top = (list) => list.sort((a, b) => b.rss_mb - a.rss_mb).slice(0, 12)
      .map((m) => ({ ...m, rss_mb: Math.round(m.rss_mb * 10) / 10, size_mb: Math.round(m.size_mb) }));
    return {
      anon_mb: statusField(status, 'RssAnon') / 1024,
      file_mb: statusField(status, 'RssFile') / 1024,
      shmem_mb: statusField(status, 'RssShmem') / 1024,
      anon_by_perms_mb: anonByPerms,
      largest_mappings: top(mappings),
      by_name: top(Object.entries(byName).map(([name, rss_mb]) => ({ name, rss_mb, size_mb: 0 }))),
    };
  } catch (e) {
    return { error: String(e) };
  }
}

const nextAnswer = (chat) => chat.evaluate((el) => new Promise((resolve) => {
  el.addEventListener('corolla-answer', (e) => resolve(e.detail), { once: true });
}));
const messageCount = (chat) => chat.evaluate((el) => el.shadowRoot.querySelectorAll('.msg').length);

async function uiCheck(page, chat) {
  const markdown = await page.evaluate(async () => {
    const m = await import(new URL('markdown.js', location.href).href);
    const div = document.createElement('div');
    m.renderMarkdown(div, 'Hi **there** <img src=x onerror="window.__xss=1">\n\n' +
      '```js\nlet a = 1;\n```\n- one\n- two\n\n[link](https://example.org) `x`');
    return {
      imgs: div.querySelectorAll('img').length,
      code: div.querySelector('.code pre code')?.textContent ?? null,
      copy: !!div.querySelector('.code .copy'),
      strong: div.querySelector('strong')?.textContent ?? null,
      items: div.querySelectorAll('li').length,
      link: div.querySelector('a')?.getAttribute('href') ?? null,
      raw_html_as_text: div.textContent.includes('<img src=x'),
    };
  });
  emit({ event: 'markdown', ...markdown });

  let answer = nextAnswer(chat);
  await page.locator('corolla-chat .regenerate').click();
  emit({ event: 'regenerated', result: await answer });

  const beforeEdit = await messageCount(chat);
  await page.locator('corolla-chat .msg.user .edit').last().click();
  const editing = await chat.evaluate((el) => el.shadowRoot.querySelector('#input').value);
  emit({ event: 'edit', input: editing, before: beforeEdit, after: await messageCount(chat) });
  await page.locator('corolla-chat #input').fill(`${editing} Answer in one word.`);
  answer = nextAnswer(chat);
  await page.locator('corolla-chat #send').click();
  emit({ event: 'edited', result: await answer });

  const kept = await messageCount(chat);
  await navigate(() => page.reload());
  await page.waitForFunction(() => document.querySelector('corolla-chat')?.state === 'ready',
    null, { timeout, polling: 100 });
  emit({ event: 'restored', before: kept, after: await messageCount(chat) });

  await page.locator('corolla-chat #new').click();
  emit({
    event: 'new_chat',
    messages: await messageCount(chat),
    examples: await chat.evaluate((el) => el.shadowRoot.querySelectorAll('.examples button').length),
  });
  if (args.screenshot) {
    await page.emulateMedia({ colorScheme: 'dark' });
    await page.screenshot({ path: args.screenshot.replace(/\.png$/, '-dark-empty.png'), fullPage: true });
    await page.emulateMedia({ colorScheme: 'light' });
  }
  // An example prompt answers like a typed one.
  answer = nextAnswer(chat);
  await page.locator('corolla-chat .examples button').first().click();
  emit({ event: 'example', result: await answer });
  if (args.screenshot) {
    await page.emulateMedia({ colorScheme: 'dark' });
    await page.screenshot({ path: args.screenshot.replace(/\.png$/, '-dark.png'), fullPage: true });
    await page.emulateMedia({ colorScheme: 'light' });
  }
}

const profile = mkdtempSync(join(tmpdir(), 'corolla-chromium-'));
const privateWatch = args.measure ? new PrivateMemoryWatch(profile) : null;
// A fresh profile per run (Playwright wants it as the persistent context's folder).
const context = await chromium.launchPersistentContext(profile, {
  executablePath: args.chromium,
  ignoreHTTPSErrors: true,
  viewport: { width, height },
  args: [
    '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync',
    // WebRTC offers host candidates only to pages allowed the camera, and
    // never on loopback unless told to.
    '--allow-loopback-in-peer-connection',
    '--disable-features=WebRtcHideLocalIpsWithMdns',
    '--use-fake-ui-for-media-stream', '--use-fake-device-for-media-stream',
    // Tests serve https/wss with a self-signed certificate.
    '--ignore-certificate-errors',
  ],
});
let failed = false;
// Uncaught page errors and console errors: each one fails the run.
const pageErrors = [];
const allowed = args['allow-console-error'] ? new RegExp(args['allow-console-error']) : null;
try {
  // Secure origins only (https, localhost); the flag above covers the rest.
  await context
    .grantPermissions(['camera', 'microphone'], { origin: new URL(args.url).origin })
    .catch(() => {});
  const page = await context.newPage();
  page.on('console', (m) => {
    console.error(`[page ${m.type()}] ${m.text()}`);
    if (m.type() === 'error' && !(allowed && allowed.test(m.text()))) {
      pageErrors.push(`console error: ${m.text()}`);
    }
  });
  page.on('pageerror', (e) => {
    console.error(`[page error] ${e.message}\n${e.stack ?? ''}`);
    pageErrors.push(`uncaught: ${e.message}`);
  });
  await page.exposeFunction('__corollaReport', (event) => emit(event));
  // Every task that held the page's thread over 50 ms, from the start of each document.
  await page.addInitScript(() => {
    window.__corollaLongTasks = [];
    new PerformanceObserver((list) => {
      for (const t of list.getEntries()) {
        window.__corollaLongTasks.push({ start_ms: t.startTime, duration_ms: t.duration });
      }
    }).observe({ type: 'longtask', buffered: true });
  });
  const longTasks = async (phase) => emit({
    event: 'long_tasks',
    phase,
    tasks: await page.evaluate(() => window.__corollaLongTasks ?? []),
    marks: await page.evaluate(() => Object.fromEntries(
      performance.getEntriesByType('mark').map((m) => [m.name, m.startTime]))),
  });
  const loadStarted = Date.now();
  privateWatch?.mark('navigate');
  await navigate(() => page.goto(args.url));
  privateWatch?.mark('loaded');

  const chat = page.locator('corolla-chat');
  const state = await page.waitForFunction(() => {
    const el = document.querySelector('corolla-chat');
    return el && (el.state === 'ready' || el.state === 'error') && el.state;
  }, null, { timeout, polling: 100 }).then((h) => h.jsonValue());
  if (state !== 'ready') {
    const message = await chat.evaluate((el) => el.lastError);
    throw new Error(`the page did not get ready: ${message}`);
  }
  privateWatch?.mark('ready');
  emit({
    event: 'ready',
    ready_ms: Date.now() - loadStarted,
    info: await chat.evaluate((el) => el.client.info()),
    system: await chat.evaluate((el) => el.getAttribute('system')),
  });

  // Where Send/Stop, the input and the header are, before and while answering.
  const geometry = (selector) => chat.evaluate((el, sel) => {
    const r = (q) => {
      const b = el.shadowRoot.querySelector(q).getBoundingClientRect();
      return { x: b.x, y: b.y, w: b.width, h: b.height };
    };
    return { button: r(sel), input: r('#input'), header: r('header') };
  }, selector);
  const before = await geometry('#send');
  await chat.evaluate((el) => {
    el.addEventListener('corolla-token', (e) => {
      if (e.detail.count === 1) {
        const r = (q) => {
          const b = el.shadowRoot.querySelector(q).getBoundingClientRect();
          return { x: b.x, y: b.y, w: b.width, h: b.height };
        };
        window.__corollaDuring ??= { button: r('#stop'), input: r('#input'), header: r('header') };
      }
      if (e.detail.count === 1) {
        const at = Date.now();
        // Asked before the loop goes on, so no later row fetch is counted.
        el.client.traffic().then(
          (traffic) => window.__corollaReport({ event: 'token', count: 1, at_ms: at, traffic }),
          (err) => window.__corollaReport({ event: 'token', count: 1, at_ms: at, traffic_error: String(err) }));
      }
      if (e.detail.count === window.__corollaStopAt) {
        el.shadowRoot.querySelector('#stop').click();
      }
    });
  });
  await page.locator('corolla-chat #settings summary').click().catch(() => {});
  await page.locator('corolla-chat #temperature').fill(args.temperature);
  await page.locator('corolla-chat #max-new-tokens').fill(args['max-new-tokens']);

  for (const [i, prompt] of args.prompt.entries()) {
    if (args['stop-after-tokens'] && i === args.prompt.length - 1) {
      await page.evaluate((n) => { window.__corollaStopAt = n; }, Number(args['stop-after-tokens']));
    }
    const done = chat.evaluate((el) => new Promise((resolve) => {
      const finish = (kind) => (e) => {
        el.removeEventListener('corolla-answer', onAnswer);
        el.removeEventListener('corolla-error', onError);
        resolve({ kind, detail: e.detail });
      };
      const onAnswer = finish('answer');
      const onError = finish('error');
      el.addEventListener('corolla-answer', onAnswer);
      el.addEventListener('corolla-error', onError);
    }));
    await page.locator('corolla-chat #input').fill(prompt);
    await page.locator('corolla-chat #send').click();
    const outcome = await Promise.race([
      done,
      new Promise((_, reject) => setTimeout(() => reject(new Error('no answer in time')), timeout)),
    ]);
    if (outcome.kind === 'error') {
      failed = true;
      const banner = await chat.evaluate((el) => el.shadowRoot.querySelector('#error')?.textContent ?? null);
      emit({ event: 'error', message: outcome.detail.message, kind: outcome.detail.kind, banner });
      break;
    }
    privateWatch?.mark(`answer ${i}`);
    emit({ event: 'answer', result: outcome.detail });
  }
  emit({ event: 'geometry', before, during: await page.evaluate(() => window.__corollaDuring ?? null) });
  await longTasks('cold');
  if (args.measure) {
    const memory = {
      event: 'memory',
      ...rendererMemory(profile),
      renderer_private_peak_bytes: privateWatch.take(),
      renderer_private_series_mb: privateWatch.series,
      renderer_private_marks: privateWatch.marks,
      traffic: await chat.evaluate((el) => el.client.traffic()),
    };
    emit(memory);
    if (args.screenshot) {
      writeFileSync(args.screenshot.replace(/\.png$/, '-memory.json'), JSON.stringify(memory, null, 1));
    }
  }
  if (args['warm-rerun'] && !failed) {
    privateWatch?.take();
    const reloaded = Date.now();
    await navigate(() => page.reload());
    await page.waitForFunction(() => document.querySelector('corolla-chat')?.state === 'ready',
      null, { timeout, polling: 100 });
    const readyMs = Date.now() - reloaded;
    await page.locator('corolla-chat #new').click();
    const first = chat.evaluate((el) => new Promise((resolve) => {
      el.addEventListener('corolla-token', () => resolve(Date.now()), { once: true });
    }));
    const answer = nextAnswer(chat);
    await page.locator('corolla-chat #settings summary').click().catch(() => {});
    await page.locator('corolla-chat #temperature').fill(args.temperature);
    await page.locator('corolla-chat #max-new-tokens').fill(args['max-new-tokens']);
    await page.locator('corolla-chat #input').fill(args.prompt[0]);
    const sent = Date.now();
    await page.locator('corolla-chat #send').click();
    const firstAt = await first;
    const result = await answer;
    await longTasks('warm');
    emit({
      event: 'warm',
      ready_ms: readyMs,
      first_token_ms: firstAt - sent,
      result,
      traffic: await chat.evaluate((el) => el.client.traffic()),
      ...rendererMemory(profile),
      renderer_private_peak_bytes: privateWatch?.take() ?? 0,
    });
  }
  if (args['ui-check'] && !failed) await uiCheck(page, chat);
  // Wider than the viewport means sideways scrolling: unusable on a phone.
  emit({
    event: 'layout',
    scroll_width: await page.evaluate(() => document.documentElement.scrollWidth),
    viewport_width: width,
  });
  if (args['reload-check'] && !failed) {
    let fetched = 0;
    page.on('request', (r) => {
      const path = new URL(r.url()).pathname;
      if (path.startsWith('/model/') && !path.endsWith('/manifest.json')) fetched += 1;
    });
    await navigate(() => page.reload());
    await page.waitForFunction(() => document.querySelector('corolla-chat')?.state === 'ready',
      null, { timeout, polling: 100 });
    emit({ event: 'reload', model_files_fetched: fetched });
  }
  if (args.screenshot) {
    await page.screenshot({ path: args.screenshot, fullPage: true });
  }
} catch (e) {
  failed = true;
  emit({ event: 'error', message: String(e && e.message ? e.message : e) });
} finally {
  privateWatch?.stop();
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
if (pageErrors.length > 0) {
  failed = true;
  emit({ event: 'page_errors', errors: pageErrors });
}
process.exit(failed ? 1 : 0);
