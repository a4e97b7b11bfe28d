// The one helper every page script uses to talk to serve/app.py's /api routes: JSON in and out, with the
// session's two halves: the cookie (HttpOnly: no script here sees it) and the key the login answered,
// kept in this origin's localStorage and sent as X-Session-Key (a page on another port of the same host
// receives the cookie, since cookies know no ports, but never this key). index.html loads this file first.
"use strict";

const SESSION_KEY = "enlace_session_key";

// Headers every request to /api carries: the session key when there is one.
function sessionHeaders() {
  const key = localStorage.getItem(SESSION_KEY);
  return key ? { "X-Session-Key": key } : {};
}

// A link to a JSON download (an export): a plain link would carry the cookie but not the session key, so
// its click fetches the file through api() and saves what came.
function jsonDownload(link) {
  link.addEventListener("click", (event) => {
    event.preventDefault();
    api("GET", link.getAttribute("href")).then((reply) => {
      const save = document.createElement("a");
      save.href = URL.createObjectURL(new Blob([JSON.stringify(reply, null, 1)], { type: "application/json" }));
      save.download = link.download;
      save.click();
      setTimeout(() => URL.revokeObjectURL(save.href), 1000);
    }).catch(() => {});
  });
  return link;
}

// A failed request's Error: the server's message (in English), or the Spanish one that `spanish` gives
// for its code (the errors a member can cause on that page), with the HTTP status and the code.
async function errorOf(response, spanish = {}) {
  let detail = {};
  try {
    detail = (await response.json()).error || {};
  } catch (_) { /* not JSON */ }
  const error = new Error(spanish[detail.code] || detail.message || `Error ${response.status}`);
  error.status = response.status;
  error.code = detail.code || null;
  return error;
}

// METHOD path with an optional JSON body; the reply's JSON (null when it has none), or errorOf's Error.
async function api(method, path, body, spanish = {}) {
  const options = { method, headers: sessionHeaders(), credentials: "same-origin" };
  if (body !== undefined) {
    options.headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const response = await fetch(path, options);
  if (path === "/api/logout") localStorage.removeItem(SESSION_KEY);
  if (!response.ok) throw await errorOf(response, spanish);
  const reply = await response.json().catch(() => null);
  if (reply && reply.session_key) localStorage.setItem(SESSION_KEY, reply.session_key);
  return reply;
}
