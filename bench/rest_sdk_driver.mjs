// REST prompts driven the way qwen's own SDK sends them (@qwen-code/sdk, its daemon entry, unchanged):
// DaemonSessionClient.createOrAttach (a thread session), one events() subscription held open, then
// sequential prompts, each submitted with submitPrompt (POST /session/:id/prompt through Node's fetch,
// undici: the request prompt() sends on its subscription path) and done when its turn_complete comes
// on that subscription. Not prompt() itself: it registers its promptId only once the 202's body is
// read, and an echo turn's turn_complete can be read before that (prompt() then waits forever).
//
// Usage: node rest_sdk_driver.mjs SDK_DAEMON_ENTRY BASE_URL WARMUP PROMPTS TEXT
// It prints {"ready": true} after the warm-up prompts, waits for one line on stdin, runs the timed
// prompts, prints {"done": true, "seconds": S, "frames": N} (N: frames seen while timed), then waits
// for one more line (or the end of stdin) and closes the session. bench/rest_bench.py reads the
// server's CPU (or instructions) between "ready" and "done".
import { createInterface } from 'node:readline';
import { pathToFileURL } from 'node:url';

const [entry, base, warmupArg, promptsArg, text] = process.argv.slice(2);
const { DaemonClient, DaemonSessionClient } = await import(pathToFileURL(entry).href);
const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
const out = (o) => process.stdout.write(JSON.stringify(o) + '\n');

const client = new DaemonClient({ baseUrl: base });
const session = await DaemonSessionClient.createOrAttach(client, { cwd: '/tmp', sessionScope: 'thread' });
const ac = new AbortController();
let frames = 0;
const waiting = new Map(); // promptId -> resolve
const ended = new Set(); // promptIds whose turn_complete came before their 202 was read
let opened;
const open = new Promise((resolve) => { opened = resolve; });
const reading = (async () => {
  try {
    const events = session.events({ signal: ac.signal });
    opened();
    for await (const ev of events) {
      frames += 1;
      if (ev.type !== 'turn_complete' && ev.type !== 'turn_error') continue;
      const id = ev.data.promptId;
      if (ev.type === 'turn_error' || ev.data.stopReason !== 'end_turn') throw new Error(`turn ended ${JSON.stringify(ev)}`);
      const resolve = waiting.get(id);
      if (resolve) { waiting.delete(id); resolve(); } else ended.add(id);
    }
  } catch (e) { if (!ac.signal.aborted) throw e; }
})();
await open;
const body = { prompt: [{ type: 'text', text }] };
const run = async (n) => {
  for (let i = 0; i < n; i++) {
    const { promptId } = await session.submitPrompt(body);
    if (ended.delete(promptId)) continue;
    await new Promise((resolve) => waiting.set(promptId, resolve));
  }
};
await run(Number(warmupArg));
out({ ready: true });
await lines.next();
const frames0 = frames;
const started = performance.now();
await run(Number(promptsArg));
out({ done: true, seconds: (performance.now() - started) / 1000, frames: frames - frames0 });
await lines.next();
ac.abort();
await reading;
await session.close();
process.exit(0);
