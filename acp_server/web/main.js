// The console's entry point: one WebSocket to this server's /acp, shared by both views.

import { OpsView } from "./ops.js";
import { Rpc, storedToken } from "./rpc.js";
import { SessionsView } from "./sessions.js";
import { setText } from "./dom.js";

const scheme = location.protocol === "https:" ? "wss:" : "ws:";
const conn = document.getElementById("conn");
const tokenForm = document.getElementById("token-form");
const tokenError = document.getElementById("token-error");
const signOut = document.getElementById("sign-out");
const ops = new OpsView();
const LABELS = { open: "connected", token: "sign-in needed", limited: "sign-in paused", closed: "reconnecting" };

const rpc = new Rpc(`${scheme}//${location.host}/acp`, {
  onState(state, detail) {
    conn.dataset.state = state;
    setText(conn, LABELS[state] ?? "connecting");
    conn.title = detail ? String(detail) : "";
    tokenForm.hidden = state !== "token" && state !== "limited";
    if (state === "token") {
      const refused = detail === "refused";
      tokenError.dataset.kind = refused ? "unauthorized" : "needed";
      setText(tokenError, refused
        ? "The server refused that token (401 unauthorized): it is wrong, expired or revoked. Check it and sign in again."
        : "This server asks for a token (--auth-tokens). Paste yours to sign in; it is kept for this tab only.");
      document.getElementById("token-input").focus();
    } else if (state === "limited") {
      tokenError.dataset.kind = "rate_limited";
      setText(tokenError, String(detail ?? "too many failed sign-ins"));
    }
    tokenError.hidden = state !== "token" && state !== "limited";
    signOut.hidden = state !== "open" || storedToken() === null;
  },
  async onOpen(client) {
    await Promise.allSettled([ops.subscribe(client), sessions.reopened()]);
  },
  onNotification(method, params) {
    if (method === "_acp_server/stats/snapshot") ops.render(params);
    else sessions.notification(method, params);
  },
  onRequest(method, params) {
    if (method === "session/request_permission") return sessions.requestPermission(params);
    return Promise.reject(Object.assign(new Error(`the console does not handle ${method}`), { code: -32601 }));
  },
});
const sessions = new SessionsView(rpc);

tokenForm.addEventListener("submit", (event) => {
  event.preventDefault();
  const input = document.getElementById("token-input");
  const token = input.value.trim();
  input.value = "";
  if (token) rpc.signIn(token);
});
signOut.addEventListener("click", () => rpc.signIn(""));

for (const [tab, view] of [["tab-ops", "view-ops"], ["tab-sessions", "view-sessions"]]) {
  document.getElementById(tab).addEventListener("click", () => {
    for (const [t, v] of [["tab-ops", "view-ops"], ["tab-sessions", "view-sessions"]]) {
      document.getElementById(t).setAttribute("aria-selected", String(t === tab));
      document.getElementById(v).hidden = v !== view;
    }
    location.hash = view === "view-sessions" ? "#sessions" : "";
  });
}
if (location.hash === "#sessions") document.getElementById("tab-sessions").click();

rpc.connect();
