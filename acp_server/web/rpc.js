// JSON-RPC 2.0 over the page's WebSocket to /acp: calls, notifications, the agent's requests, and a
// reconnect with backoff when the socket drops (a server restart): every call in flight then fails
// with a readable "connection_lost" error and `onOpen` runs again once the new socket is initialized.
//
// With tokens (--auth-tokens) the socket offers the token as the subprotocol `acp-bearer.<base64url>`
// beside `acp.v1`, and fetches send it as `Authorization: Bearer`. A browser does not say why a
// handshake failed, so after a socket closes the page asks `GET /capabilities` with the same token:
// 401 means the server wants a (different) token, and the page waits for the sign-in form instead of
// reconnecting; 429 means too many failed sign-ins from here, retried after its Retry-After.

const TOKEN_KEY = "acp-server.token";
const RETRY_MIN_MS = 250;
const RETRY_MAX_MS = 4000;

/** An error answer (or a lost connection) with its ACP errorKind and data. */
export class RpcError extends Error {
  constructor(error) {
    super(String(error.message ?? "error"));
    this.code = error.code;
    this.data = error.data && typeof error.data === "object" ? error.data : {};
    this.kind = typeof this.data.errorKind === "string" ? this.data.errorKind : null;
  }
}

/** The token the operator typed, kept for this tab only. */
export function storedToken() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function storeToken(token) {
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  else sessionStorage.removeItem(TOKEN_KEY);
}

function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  let binary = "";
  for (const b of bytes) binary += String.fromCharCode(b);
  return btoa(binary).replaceAll("+", "-").replaceAll("/", "_").replace(/=+$/, "");
}

/** The WebSocket subprotocols: ACP's, and the bearer token as `acp-bearer.<base64url>` when one is kept. */
export function subprotocols() {
  const token = storedToken();
  return token ? ["acp.v1", "acp-bearer." + base64url(token)] : ["acp.v1"];
}

/** The headers of a fetch to this server: the kept token as a bearer. */
export function authHeaders() {
  const token = storedToken();
  return token ? { Authorization: `Bearer ${token}` } : {};
}

/**
 * Why the socket could not stay open, asked over HTTP with the same token: `{status, retryAfterS,
 * message}` (`status` null: the server did not answer at all; `message`: an error body's `error`).
 */
export async function probe() {
  try {
    const answer = await fetch("/capabilities", { headers: authHeaders(), cache: "no-store", credentials: "omit" });
    const body = answer.ok ? null : await answer.json().catch(() => null);
    const message = typeof body?.error === "string" ? body.error : "";
    return { status: answer.status, retryAfterS: Number(answer.headers.get("retry-after")) || 0, message };
  } catch {
    return { status: null, retryAfterS: 0, message: "" };
  }
}

export class Rpc {
  /**
   * @param {string} url the ws:// or wss:// URL of /acp
   * @param {object} hooks onOpen(rpc) after initialize; onNotification(method, params);
   *   onRequest(method, params) -> Promise of a result; onState(state, detail)
   */
  constructor(url, hooks) {
    this.url = url;
    this.hooks = hooks;
    this.nextId = 1;
    this.pending = new Map();
    this.ws = null;
    this.ready = false;
    this.retryMs = RETRY_MIN_MS;
    this.initResult = null;
    this.timer = null;
  }

  connect() {
    clearTimeout(this.timer);
    this.timer = null;
    this.hooks.onState?.("connecting");
    let ws;
    try {
      ws = new WebSocket(this.url, subprotocols());
    } catch (err) {
      this.scheduleReconnect(String(err));
      return;
    }
    this.ws = ws;
    ws.onopen = () => {
      document.body.dataset.subprotocol = ws.protocol; // what the server chose of what was offered
      this.initialize();
    };
    ws.onmessage = (event) => this.receive(event.data);
    ws.onclose = () => {
      if (this.ws !== ws) return;
      this.ready = false;
      this.ws = null;
      for (const [, waiter] of this.pending) {
        waiter.reject(new RpcError({ code: -32000, message: "the connection to the server was lost", data: { errorKind: "connection_lost" } }));
      }
      this.pending.clear();
      this.closed();
    };
  }

  /** The socket closed (or never opened): sign in, wait out a rate limit, or reconnect. */
  async closed() {
    this.hooks.onState?.("closed", "checking");
    const { status, retryAfterS, message } = await probe();
    if (this.ws) return; // a sign-in reconnected meanwhile
    if (status === 401) {
      const refused = storedToken() !== null;
      storeToken(null); // a refused token is not offered again
      this.hooks.onState?.("token", refused ? "refused" : "needed");
      return; // until signIn()
    }
    if (status === 429) {
      // too many failed sign-ins from this address, or too many requests with this token
      this.hooks.onState?.("limited", `${message || "rate limited"}; retrying in ${Math.max(retryAfterS, 1)} s`);
      this.later(Math.max(retryAfterS, 1) * 1000);
      return;
    }
    this.scheduleReconnect(status === null ? "the server does not answer" : "closed");
  }

  scheduleReconnect(detail) {
    this.hooks.onState?.("closed", detail);
    const wait = this.retryMs;
    this.retryMs = Math.min(this.retryMs * 2, RETRY_MAX_MS);
    this.later(wait);
  }

  later(ms) {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.connect(), ms);
  }

  /** Keep `token` for this tab (empty: forget it) and connect with it now. */
  signIn(token) {
    storeToken(token);
    this.retryMs = RETRY_MIN_MS;
    if (this.ws) this.ws.close(); // its close reconnects with the new token
    else this.connect();
  }

  async initialize() {
    try {
      this.initResult = await this.send("initialize", {
        protocolVersion: 1,
        clientCapabilities: { fs: { readTextFile: false, writeTextFile: false }, terminal: false },
        clientInfo: { name: "acp-server-console", version: "1" },
        _meta: { turnStates: true },
      });
    } catch (err) {
      this.hooks.onState?.(err.kind === "auth_required" ? "token" : "closed", err.message);
      return;
    }
    this.ready = true;
    this.retryMs = RETRY_MIN_MS;
    this.hooks.onState?.("open");
    await this.hooks.onOpen?.(this);
  }

  /** Send a request; resolves with its result, rejects with an RpcError. */
  send(method, params) {
    return this.request(method, params).done;
  }

  /**
   * Send a request and say which id it went with: `{id, done}` (`id` is null when it could not go
   * out). The id is what `cancel(id)` names in `$/cancel_request`.
   */
  request(method, params) {
    const ws = this.ws;
    if (!ws || ws.readyState !== WebSocket.OPEN) {
      const lost = new RpcError({ code: -32000, message: "not connected to the server (reconnecting)", data: { errorKind: "connection_lost" } });
      return { id: null, done: Promise.reject(lost) };
    }
    const id = this.nextId++;
    const done = new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      ws.send(JSON.stringify({ jsonrpc: "2.0", id, method, params }));
    });
    return { id, done };
  }

  /** `$/cancel_request` for a request of ours still in flight on this socket; false if there is none. */
  cancel(id) {
    if (id === null || !this.pending.has(id)) return false;
    this.notify("$/cancel_request", { requestId: id });
    return true;
  }

  call(method, params) {
    return this.send(method, params);
  }

  notify(method, params) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(JSON.stringify({ jsonrpc: "2.0", method, params }));
    }
  }

  receive(text) {
    let msg;
    try {
      msg = JSON.parse(text);
    } catch {
      return;
    }
    for (const one of Array.isArray(msg) ? msg : [msg]) this.dispatch(one);
  }

  dispatch(msg) {
    if (msg.method !== undefined && msg.id !== undefined) {
      this.answerRequest(msg);
    } else if (msg.method !== undefined) {
      this.hooks.onNotification?.(msg.method, msg.params ?? {});
    } else if (this.pending.has(msg.id)) {
      const waiter = this.pending.get(msg.id);
      this.pending.delete(msg.id);
      if (msg.error) waiter.reject(new RpcError(msg.error));
      else waiter.resolve(msg.result);
    }
  }

  async answerRequest(msg) {
    const ws = this.ws;
    let reply;
    try {
      const result = await this.hooks.onRequest(msg.method, msg.params ?? {});
      reply = { jsonrpc: "2.0", id: msg.id, result };
    } catch (err) {
      reply = { jsonrpc: "2.0", id: msg.id, error: { code: err.code ?? -32601, message: String(err.message) } };
    }
    if (ws && ws === this.ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(reply));
  }
}
