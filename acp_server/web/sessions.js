// The sessions view: list, open (session/load renders the replay), prompt, stream the updates with
// the turn states the server reports, cancel, answer permission requests, show refusals with their
// retry time. A stale client id is healed once with session/resume, as the SDK does.

import { el, setText } from "./dom.js";

const HEALED_BY_RESUME = new Set(["invalid_client_id", "session_not_established"]);
const TERMINAL = new Set(["completed", "failed", "cancelled", "refused"]);
const CWD = "/";

function textOf(content) {
  if (!content) return "";
  if (Array.isArray(content)) return content.map(textOf).join("");
  if (content.type === "text") return String(content.text ?? "");
  if (content.type === "content") return textOf(content.content);
  return `[${String(content.type ?? "content")}]`;
}

/** "prompt_queue_full: the session has 2 prompts pending; retry in 1.0 s (at 11:52:03)". */
export function describeRefusal(err) {
  const parts = [];
  const retry = Number(err.data?.retryAfterMs);
  if (Number.isFinite(retry) && retry > 0) {
    const at = new Date(Date.now() + retry).toLocaleTimeString();
    parts.push(`retry in ${(retry / 1000).toFixed(1)} s (at ${at})`);
  }
  return { kind: err.kind ?? `error ${err.code ?? ""}`.trim(), message: err.message, retry: parts.join("") };
}

export class SessionsView {
  constructor(rpc) {
    this.rpc = rpc;
    this.list = document.getElementById("session-list");
    this.transcript = document.getElementById("transcript");
    this.title = document.getElementById("chat-title");
    this.turn = document.getElementById("turn");
    this.turnState = document.getElementById("turn-state");
    this.turnDetail = document.getElementById("turn-detail");
    this.notice = document.getElementById("notice");
    this.input = document.getElementById("prompt-input");
    this.sendButton = document.getElementById("send");
    this.cancelButton = document.getElementById("cancel");
    this.current = null; // {sessionId, cwd, clientId}
    this.agentMessage = null; // the agent message chunks are appended to
    this.tools = new Map(); // toolCallId -> {box, title, status}
    this.permissions = new Set(); // resolvers of the permission requests shown
    this.busy = false;
    this.mine = null; // the prompt id of this page's prompt, once the server named it
    this.sentAs = null; // the client id this page's prompt went out as (turn states name it)
    this.inflight = null; // the JSON-RPC id of this page's session/prompt (what cancel names)
    document.getElementById("prompt-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.prompt();
    });
    this.input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) this.prompt();
    });
    this.cancelButton.addEventListener("click", () => this.cancel());
    document.getElementById("refresh").addEventListener("click", () => this.refresh());
    document.getElementById("new-session").addEventListener("click", () => this.create());
  }

  /** A (re)opened connection: list again and re-attach the open session (its replay is re-rendered). */
  async reopened() {
    await this.refresh();
    if (this.current) await this.open(this.current.sessionId, this.current.cwd);
  }

  async refresh() {
    let sessions = [];
    try {
      let cursor;
      do {
        const result = await this.rpc.call("session/list", cursor ? { cursor } : {});
        sessions = sessions.concat(result.sessions ?? []);
        cursor = result.nextCursor;
      } while (cursor && sessions.length < 500);
    } catch (err) {
      this.showError(err);
      return;
    }
    this.list.replaceChildren(
      ...sessions.map((s) => {
        const li = el("li", "", s.sessionId);
        li.dataset.sessionId = s.sessionId;
        li.append(el("span", "meta", [s.title, s.updatedAt].filter(Boolean).join(" · ") || s.cwd || ""));
        if (this.current?.sessionId === s.sessionId) li.setAttribute("aria-current", "true");
        li.addEventListener("click", () => this.open(s.sessionId, s.cwd || CWD));
        return li;
      }),
    );
  }

  async create() {
    try {
      const result = await this.rpc.call("session/new", { cwd: CWD, mcpServers: [] });
      this.show(result.sessionId, CWD);
      this.attached(result);
      await this.refresh();
    } catch (err) {
      this.showError(err);
    }
  }

  /** Show an empty transcript for `sessionId` (what the server sends next fills it). */
  show(sessionId, cwd) {
    this.current = { sessionId, cwd, clientId: null };
    this.transcript.replaceChildren();
    this.agentMessage = null;
    this.tools.clear();
    this.hideNotice();
    setText(this.title, sessionId);
    this.setTurn("none", "loading", "");
    for (const li of this.list.children) li.toggleAttribute("aria-current", li.dataset.sessionId === sessionId);
  }

  /** The session is attached on this connection (`result` of session/new, load or resume). */
  attached(result) {
    this.current.clientId = result?._meta?.clientId ?? null;
    if (this.turn.dataset.state === "none") this.setTurn("none", "idle", "");
    this.input.disabled = false;
    this.sendButton.disabled = this.busy;
    this.transcript.dataset.loaded = "true";
  }

  /** Open a session: `session/load` renders its replay (`session/resume` when the agent cannot load). */
  async open(sessionId, cwd) {
    this.show(sessionId, cwd);
    try {
      let result;
      try {
        result = await this.rpc.call("session/load", { sessionId, cwd, mcpServers: [] });
      } catch (err) {
        if (err.kind === "connection_lost") throw err;
        result = await this.rpc.call("session/resume", { sessionId, cwd, mcpServers: [] });
        this.transcript.appendChild(el("div", "msg note", `no replay: ${err.message}`));
      }
      if (this.current?.sessionId !== sessionId) return;
      this.attached(result);
    } catch (err) {
      this.setTurn("none", "not loaded", "");
      this.showError(err);
    }
  }

  setTurn(state, label, detail) {
    this.turn.dataset.state = state;
    setText(this.turnState, label);
    setText(this.turnDetail, detail);
    if (state !== "none") this.turn.dataset.seen = `${this.turn.dataset.seen ?? ""}${state} `;
  }

  // --- what the server sends ------------------------------------------------------------------------

  notification(method, params) {
    if (!this.current || params.sessionId !== this.current.sessionId) return;
    if (method === "session/update") this.update(params.update ?? {});
    else if (method === "_acp_server/turn_state") this.turnStateChanged(params);
  }

  /**
   * Only this page's prompt moves the turn bar. A live turn state names the client id its prompt was
   * sent as (`_meta.originatorClientId`); this page's prompt is the one `accepted` under the client
   * id it sent with, while it awaits the answer (one prompt at a time per page). Other clients' prompts
   * on the session, another tab's included, are not shown here.
   */
  turnStateChanged(params) {
    const state = String(params.state ?? "");
    if (state === "running" || TERMINAL.has(state)) this.agentMessage = null; // any prompt's answer stands apart
    const origin = params._meta?.originatorClientId;
    if (this.mine === null && this.busy && state === "accepted" && origin != null && origin === this.sentAs) {
      this.mine = String(params.promptId);
      this.turn.dataset.promptId = this.mine;
    }
    if (this.mine === null || params.promptId !== this.mine) return;
    let detail = "";
    if (params.reason) detail = String(params.reason);
    else if (state === "queued" && params.positionHint != null) detail = `position ${params.positionHint} in the waiting room`;
    else if (state === "queued") detail = "in the waiting room for a seat";
    else if (state === "waiting_for_dependency") detail = "waiting for a backend permit";
    else if (state === "paused_for_approval") detail = "the agent asks for permission";
    this.setTurn(state, state.replaceAll("_", " "), detail);
  }

  update(update) {
    const kind = update.sessionUpdate;
    if (kind === "agent_message_chunk" || kind === "agent_thought_chunk") {
      if (!this.agentMessage) this.agentMessage = this.transcript.appendChild(el("div", "msg agent"));
      this.agentMessage.append(document.createTextNode(textOf(update.content)));
    } else if (kind === "user_message_chunk") {
      this.agentMessage = null;
      this.transcript.appendChild(el("div", "msg user", textOf(update.content)));
    } else if (kind === "tool_call" || kind === "tool_call_update") {
      this.tool(update);
    } else {
      return;
    }
    this.transcript.scrollTop = this.transcript.scrollHeight;
  }

  tool(update) {
    let tool = this.tools.get(update.toolCallId);
    if (!tool) {
      const box = this.transcript.appendChild(el("div", "msg tool"));
      box.dataset.toolCallId = String(update.toolCallId);
      const title = box.appendChild(el("span", "title", update.title ?? update.toolCallId));
      const status = box.appendChild(el("span", "status", update.status ?? ""));
      tool = { box, title, status };
      this.tools.set(update.toolCallId, tool);
      this.agentMessage = null;
    }
    if (update.title) setText(tool.title, update.title);
    if (update.status) setText(tool.status, update.status);
  }

  /** `session/request_permission`: the options as buttons; resolves with the one clicked. */
  requestPermission(params) {
    if (!this.current || params.sessionId !== this.current.sessionId) {
      return Promise.resolve({ outcome: { outcome: "cancelled" } });
    }
    const box = this.transcript.appendChild(el("div", "msg permission"));
    box.append(el("div", "", `The agent asks permission: ${params.toolCall?.title ?? params.toolCall?.toolCallId ?? "a tool call"}`));
    const row = box.appendChild(el("div", "row"));
    this.agentMessage = null;
    return new Promise((resolve) => {
      const done = (outcome, label) => {
        this.permissions.delete(finish);
        row.replaceChildren(el("span", "answered", label));
        resolve({ outcome });
      };
      const finish = () => done({ outcome: "cancelled" }, "cancelled");
      this.permissions.add(finish);
      for (const option of params.options ?? []) {
        const button = row.appendChild(el("button", "option", option.name ?? option.optionId));
        button.type = "button";
        button.dataset.optionId = String(option.optionId);
        button.addEventListener("click", () => done({ outcome: "selected", optionId: option.optionId }, `answered: ${option.name ?? option.optionId}`));
      }
    });
  }

  // --- what the operator does ---------------------------------------------------------------------

  async prompt() {
    const text = this.input.value;
    if (!this.current || this.busy || !text.trim()) return;
    this.hideNotice();
    this.busy = true;
    this.sendButton.disabled = true;
    this.cancelButton.disabled = false;
    this.turn.dataset.seen = "";
    this.mine = null;
    delete this.turn.dataset.promptId;
    delete this.turn.dataset.resultPromptId;
    this.setTurn("sent", "sent", "waiting for the server");
    this.agentMessage = null;
    const sent = this.transcript.appendChild(el("div", "msg user", text));
    this.input.value = "";
    try {
      const result = await this.promptHealed(text);
      this.named(result?._meta?.promptId);
      const stop = String(result?.stopReason ?? "end_turn");
      const state = stop === "cancelled" ? "cancelled" : "completed";
      if (this.turn.dataset.state !== state) this.setTurn(state, state, stop);
      else setText(this.turnDetail, stop);
    } catch (err) {
      this.named(err.data?.promptId);
      if (err.kind === "request_cancelled") {
        // $/cancel_request answered: the prompt ended cancelled (its turn state said so first)
        if (this.turn.dataset.state !== "cancelled") this.setTurn("cancelled", "cancelled", "request_cancelled");
      } else {
        // refused: never admitted (no accepted of ours, no promptId in the error)
        const refused = this.mine === null && err.kind !== "connection_lost";
        const state = refused ? "refused" : "failed";
        if (this.turn.dataset.state !== state) this.setTurn(state, state, err.kind ?? "");
        if (refused) sent.classList.add("refused");
        this.showError(err);
      }
    } finally {
      for (const finish of [...this.permissions]) finish();
      this.busy = false;
      this.inflight = null;
      this.sendButton.disabled = !this.current;
      this.cancelButton.disabled = true;
    }
  }

  /** The prompt id the answer names (result `_meta.promptId`, or an error's `data.promptId`). */
  named(promptId) {
    if (promptId == null) return;
    this.turn.dataset.resultPromptId = String(promptId);
    if (this.mine === null) {
      this.mine = String(promptId);
      this.turn.dataset.promptId = this.mine;
    }
  }

  async promptHealed(text) {
    const session = this.current;
    const call = () => {
      this.sentAs = session.clientId;
      const { id, done } = this.rpc.request("session/prompt", {
        sessionId: session.sessionId,
        prompt: [{ type: "text", text }],
        _meta: session.clientId ? { clientId: session.clientId } : {},
      });
      this.inflight = id;
      return done;
    };
    try {
      return await call();
    } catch (err) {
      if (!HEALED_BY_RESUME.has(err.kind)) throw err;
      // One resume without the stale id: the server mints a fresh one; then the prompt once more.
      const resumed = await this.rpc.call("session/resume", { sessionId: session.sessionId, cwd: session.cwd, mcpServers: [] });
      session.clientId = resumed?._meta?.clientId ?? null;
      this.transcript.dataset.selfHeals = String(Number(this.transcript.dataset.selfHeals ?? 0) + 1);
      return await call();
    }
  }

  /**
   * Cancel this page's prompt: `$/cancel_request` of its session/prompt request, so only this page's
   * prompt ends (`cancelled`); `session/cancel` would end every prompt of the session, another tab's
   * or another client's included.
   */
  cancel() {
    if (!this.current || !this.busy) return;
    const sent = this.rpc.cancel(this.inflight);
    for (const finish of [...this.permissions]) finish();
    setText(this.turnDetail, sent ? "cancel sent" : "nothing in flight to cancel");
  }

  showError(err) {
    const { kind, message, retry } = describeRefusal(err);
    const kindNode = el("span", "kind", kind);
    this.notice.replaceChildren(kindNode, document.createTextNode(message));
    if (retry) this.notice.append(el("div", "retry", retry));
    this.notice.dataset.kind = kind;
    this.notice.hidden = false;
  }

  hideNotice() {
    this.notice.hidden = true;
    this.notice.replaceChildren();
    delete this.notice.dataset.kind;
  }
}
