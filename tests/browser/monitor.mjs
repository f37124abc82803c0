// Drives a server's swarm monitor (/monitor) in Debian's headless Chromium:
// at each viewport, waits until the table lists every server and the
// coverage bar has one segment per block, measures the layout, takes a
// screenshot; then makes api/swarm fail and checks the page says so while
// keeping the last data. Prints one JSON line per event on stdout (`view`,
// `stale`, `error`, `page_errors`) for tests/tests/browser/monitor.rs. Any uncaught
// page error fails the run.
//
// node monitor.mjs --url URL --servers N --blocks N --screenshot-dir DIR
//                  [--name PREFIX] [--timeout-s S]

import { chromium } from 'playwright-core';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseArgs } from 'node:util';

const { values: args } = parseArgs({
  options: {
    url: { type: 'string' },
    servers: { type: 'string' },
    blocks: { type: 'string' },
    'screenshot-dir': { type: 'string' },
    name: { type: 'string', default: 'monitor' },
    'timeout-s': { type: 'string', default: '60' },
    chromium: { type: 'string', default: process.env.CHROMIUM || '/usr/bin/chromium' },
  },
});
if (!args.url || !args.servers || !args.blocks || !args['screenshot-dir']) {
  console.error('usage: node monitor.mjs --url URL --servers N --blocks N --screenshot-dir DIR');
  process.exit(2);
}
const servers = Number(args.servers);
const blocks = Number(args.blocks);
const timeout = Number(args['timeout-s']) * 1000;
const emit = (event) => console.log(JSON.stringify(event));
const shot = (label) => join(args['screenshot-dir'], `${args.name}-${label}.png`);

const VIEWS = [
  { label: 'desktop', width: 1280, height: 800, scheme: 'light' },
  { label: 'phone', width: 390, height: 844, scheme: 'light' },
  { label: 'desktop-dark', width: 1280, height: 800, scheme: 'dark' },
  { label: 'phone-dark', width: 390, height: 844, scheme: 'dark' },
];

const profile = mkdtempSync(join(tmpdir(), 'corolla-chromium-'));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: args.chromium,
  viewport: { width: VIEWS[0].width, height: VIEWS[0].height },
  args: [
    '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync',
  ],
});
let failed = false;
const pageErrors = [];
// While api/swarm is made to fail on purpose, the browser logs the failed
// loads as console errors; those are expected, any other is not.
let failingOnPurpose = false;
try {
  const page = await context.newPage();
  page.on('console', (m) => {
    console.error(`[page ${m.type()}] ${m.text()}`);
    if (m.type() === 'error' && !failingOnPurpose) pageErrors.push(`console error: ${m.text()}`);
  });
  page.on('pageerror', (e) => {
    console.error(`[page error] ${e.message}\n${e.stack ?? ''}`);
    pageErrors.push(`uncaught: ${e.message}`);
  });
  const complete = () => page.waitForFunction(
    ([n, b]) => document.querySelectorAll('#servers tbody tr.server').length === n
      && document.querySelectorAll('#coverage .seg').length === b,
    [servers, blocks],
    { timeout, polling: 100 },
  );
  const measure = () => page.evaluate(() => ({
    rows: [...document.querySelectorAll('#servers tbody tr.server')].map((r) => ({
      peer: r.dataset.peer,
      cells: [...r.querySelectorAll('td')].map((td) => td.textContent.trim()),
    })),
    segments: [...document.querySelectorAll('#coverage .seg')].map((s) => Number(s.dataset.servers)),
    gaps: document.getElementById('gaps').textContent,
    status: document.getElementById('status').textContent,
    state: document.body.dataset.state,
    error_shown: !document.getElementById('error').hidden,
    error_text: document.getElementById('error').textContent,
    scroll_width: document.documentElement.scrollWidth,
    viewport_width: window.innerWidth,
    updates: window.__monitorUpdates,
  }));

  await page.goto(args.url);
  for (const view of VIEWS) {
    await page.setViewportSize({ width: view.width, height: view.height });
    await page.emulateMedia({ colorScheme: view.scheme });
    await complete();
    // Let a resize-triggered redraw of the bar settle before the picture.
    await page.waitForTimeout(300);
    const m = await measure();
    await page.screenshot({ path: shot(view.label), fullPage: true });
    emit({ event: 'view', view: view.label, width: view.width, ...m, screenshot: shot(view.label) });
  }

  // A failed refresh: the page says so and keeps what it showed.
  await page.setViewportSize({ width: 1280, height: 800 });
  await page.emulateMedia({ colorScheme: 'light' });
  failingOnPurpose = true;
  await page.route('**/api/swarm', (route) => route.fulfill({
    status: 503,
    contentType: 'application/json',
    body: JSON.stringify({ error: 'cannot look the swarm up: test outage' }),
  }));
  await page.waitForFunction(() => !document.getElementById('error').hidden, null, { timeout, polling: 100 });
  const stale = await measure();
  await page.screenshot({ path: shot('stale'), fullPage: true });
  emit({ event: 'stale', ...stale, screenshot: shot('stale') });
  await page.unroute('**/api/swarm');
  await page.waitForFunction(() => document.getElementById('error').hidden, null, { timeout, polling: 100 });
  failingOnPurpose = false;
  emit({ event: 'recovered', ...(await measure()) });
} catch (e) {
  failed = true;
  emit({ event: 'error', message: String(e && e.message ? e.message : e) });
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
if (pageErrors.length > 0) {
  failed = true;
  emit({ event: 'page_errors', errors: pageErrors });
}
process.exit(failed ? 1 : 0);
