// The one helper every page script uses to talk to serve/app.py's /api routes: JSON in and out, with the
// session cookie (HttpOnly: no script here sees it). index.html loads this file first.
"use strict";

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
  const options = { method, headers: {}, credentials: "same-origin" };
  if (body !== undefined) {
    options.headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const response = await fetch(path, options);
  if (!response.ok) throw await errorOf(response, spanish);
  return response.json().catch(() => null);
}
