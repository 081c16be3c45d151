// The console's entry point: one WebSocket to this server's /acp, shared by both views.

import { OpsView } from "./ops.js";
import { Rpc, storeToken } from "./rpc.js";
import { SessionsView } from "./sessions.js";
import { setText } from "./dom.js";

const scheme = location.protocol === "https:" ? "wss:" : "ws:";
const conn = document.getElementById("conn");
const tokenForm = document.getElementById("token-form");
const ops = new OpsView();

const rpc = new Rpc(`${scheme}//${location.host}/acp`, {
  onState(state, detail) {
    conn.dataset.state = state;
    setText(conn, state === "open" ? "connected" : state === "token" ? "token needed" : state === "closed" ? "reconnecting" : "connecting");
    conn.title = detail ? String(detail) : "";
    tokenForm.hidden = state !== "token";
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
  storeToken(document.getElementById("token-input").value);
  rpc.ws?.close();
});

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
