// qwen's SDK (@qwen-code/sdk, unchanged) driving a live acp-server: one flow per run, one JSON line out.
// Usage: node flows.mjs BASE_URL FLOW   (tests/test_http_qwen_sdk.py runs each flow and checks its line)
import { createInterface } from 'node:readline';
import {
  DaemonClient, DaemonSessionClient, DaemonPendingPromptLimitError, isKnownDaemonEvent, DAEMON_KNOWN_EVENT_TYPE_VALUES,
} from '@qwen-code/sdk/daemon';

const [base, flow] = process.argv.slice(2);
const client = new DaemonClient({ baseUrl: base });
const text = (t) => ({ prompt: [{ type: 'text', text: t }] });
const out = (o) => process.stdout.write(JSON.stringify(o) + '\n');

async function collect(session, opts, until) {
  const frames = [];
  const ac = new AbortController();
  const done = (async () => {
    try {
      for await (const ev of session.events({ ...opts, signal: ac.signal })) {
        frames.push(ev);
        if (until(ev, frames)) break;
      }
    } catch (e) { if (!ac.signal.aborted) throw e; }
  })();
  return { frames, done, stop: () => ac.abort() };
}

const agentText = (frames) => frames
  .filter((f) => f.type === 'session_update' && f.data.update.sessionUpdate === 'agent_message_chunk')
  .map((f) => f.data.update.content.text).join('');

// The frames the SDK's own isKnownDaemonEvent rejects (their types).
const unknown = (frames) => frames.filter((f) => !isKnownDaemonEvent(f)).map((f) => f.type);

const outcome = (g) => (typeof g === 'string' ? g : g instanceof DaemonPendingPromptLimitError ? 'limit' : String(g));

const flows = {
  async basic() {
    const caps = await client.capabilities();
    const s = await DaemonSessionClient.createOrAttach(client, { cwd: '/tmp' });
    const blocking = await s.prompt(text('blocking path'));
    // events() resumes from the SDK's last seen id: it may replay the blocking turn first. The
    // subscription stays open until prompt() has its answer (the SDK reads the turn from it).
    const sub = await collect(s, {}, () => false);
    await new Promise((r) => setTimeout(r, 200));
    const subscribed = await s.prompt(text('subscription path'));
    const seen = () => sub.frames.some((f) => f.type === 'turn_complete') && agentText(sub.frames).endsWith('subscription path');
    for (let i = 0; i < 100 && !seen(); i++) await new Promise((r) => setTimeout(r, 50));
    sub.stop();
    await sub.done;
    out({
      limit: caps.limits.maxPendingPromptsPerSession, workspaceCwd: caps.workspaceCwd,
      blocking: blocking.stopReason, subscribed: subscribed.stopReason,
      types: sub.frames.map((f) => f.type), unknown: unknown(sub.frames), text: agentText(sub.frames),
      ids: sub.frames.filter((f) => f.id !== undefined).map((f) => f.id),
    });
  },
  async limit() {
    const s = await DaemonSessionClient.createOrAttach(client, { cwd: '/tmp', sessionScope: 'thread' });
    const six = Array.from({ length: 6 }, (_, i) => s.prompt(text(`p${i}`)).then((r) => r.stopReason, (e) => e));
    const got = await Promise.all(six);
    const local = got.filter((g) => g instanceof DaemonPendingPromptLimitError);
    const raw = new DaemonSessionClient({ client, session: s.session, maxPendingPromptsPerSession: null });
    const again = Array.from({ length: 6 }, (_, i) => raw.prompt(text(`q${i}`)).then((r) => r.stopReason, (e) => e));
    const got2 = await Promise.all(again);
    const remote = got2.filter((g) => g instanceof DaemonPendingPromptLimitError);
    out({
      first: got.map(outcome),
      local: local.map((e) => ({ limit: e.limit, pendingCount: e.pendingCount })),
      second: got2.map(outcome),
      remote: remote.map((e) => ({ limit: e.limit, pendingCount: e.pendingCount, sessionId: e.sessionId === s.sessionId })),
    });
  },
  async cancel() {
    const s = await DaemonSessionClient.createOrAttach(client, { cwd: '/tmp', sessionScope: 'thread' });
    const started = Date.now();
    const p = s.prompt(text('a long prompt that the echo agent takes its time over'))
      .then((r) => ({ stopReason: r.stopReason }), (e) => ({ error: e.constructor.name }));
    await new Promise((r) => setTimeout(r, 300));
    await s.cancel();
    const r = await p;
    out({ ...r, ms: Date.now() - started });
  },
  async heal() {
    const s = await DaemonSessionClient.createOrAttach(client, { cwd: '/tmp', sessionScope: 'thread' });
    const first = await s.prompt(text('before the restart'));
    const before = s.clientId;
    out({ ready: true, sessionId: s.sessionId, clientId: before });
    const rl = createInterface({ input: process.stdin });
    for await (const _ of rl) break;  // the test restarts the server, then writes a line
    const second = await s.prompt(text('after the restart'));
    out({ first: first.stopReason, second: second.stopReason, before, after: s.clientId });
    rl.close();
  },
  async resume() {
    const s = await DaemonSessionClient.createOrAttach(client, { cwd: '/tmp', sessionScope: 'thread' });
    await s.prompt(text('one'));
    const sub = await collect(s, { lastEventId: 0 }, (ev) => ev.type === 'replay_complete');
    await sub.done;
    const firstTurnEnd = sub.frames.filter((f) => f.type === 'turn_complete').map((f) => f.id)[0];
    await s.prompt(text('two three'));
    const resumed = await collect(s, { lastEventId: firstTurnEnd }, (ev) => ev.type === 'replay_complete');
    await resumed.done;
    out({
      firstTurnEnd, types: resumed.frames.map((f) => f.type), text: agentText(resumed.frames),
      unknown: unknown([...sub.frames, ...resumed.frames]),
      ids: resumed.frames.filter((f) => f.id !== undefined).map((f) => f.id),
    });
  },
  // Every kind of frame a session's stream can carry in these conditions, read raw with subscribeEvents:
  // a completed and a cancelled turn, a replay with a cursor from another bus, and the session's close.
  async kinds() {
    const s = await DaemonSessionClient.createOrAttach(client, { cwd: '/tmp', sessionScope: 'thread' });
    const frames = [];
    let epoch;
    const ac = new AbortController();
    const read = (async () => {
      for await (const ev of client.subscribeEvents(s.sessionId, { signal: ac.signal, onEpoch: (e) => { epoch = e; } })) {
        frames.push(ev);
        if (ev.type === 'session_closed') break;
      }
    })().catch((e) => { if (!ac.signal.aborted) throw e; });
    await new Promise((r) => setTimeout(r, 200));
    await s.prompt(text('done'));
    const p = s.prompt(text('a long prompt that the echo agent takes its time over')).catch(() => null);
    await new Promise((r) => setTimeout(r, 300));
    await s.cancel();
    await p;
    const resync = [];
    const ac2 = new AbortController();
    for await (const ev of client.subscribeEvents(s.sessionId, { lastEventId: 1, epoch: 'another-bus', signal: ac2.signal })) {
      resync.push(ev);
      if (ev.type === 'replay_complete') break;
    }
    await new Promise((r) => setTimeout(r, 300));
    await client.closeSession(s.sessionId);
    await Promise.race([read, new Promise((r) => setTimeout(r, 5000))]);
    ac.abort();
    const all = [...frames, ...resync];
    out({
      types: [...new Set(all.map((f) => f.type))].sort(), unknown: [...new Set(unknown(all))].sort(),
      listed: DAEMON_KNOWN_EVENT_TYPE_VALUES.filter((t) => all.some((f) => f.type === t)).sort(), epoch,
    });
  },
};

try {
  await flows[flow]();
  process.exit(0);
} catch (e) {
  out({ error: String(e && e.stack || e), name: e && e.constructor && e.constructor.name });
  process.exit(1);
}
