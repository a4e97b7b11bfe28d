// ENLACE web chat: plain JavaScript, no build step. Talks to serve/app.py's /api routes through api.js's
// api() and errorOf(). Text is always inserted with textContent, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { member: null, current: null, controller: null, passwordRequired: false };

// --- login ---------------------------------------------------------------------------------------

function showLogin() {
  state.member = null;
  $("app").hidden = true;
  $("password").hidden = true;
  $("login").hidden = false;
  $("login-name").focus();
}

async function showApp(member) {
  state.member = member;
  if (member.must_change_password) return showPassword(true);
  $("member-name").textContent = member.name;
  $("login").hidden = true;
  $("password").hidden = true;
  $("app").hidden = false;
  newConversation();
  await loadConversations();
  if (member.role === "admin") await showStorage();
}

// An admin sees what the server's disk refused (full or read-only) and where, until a write goes through.
async function showStorage() {
  const status = await api("GET", "/api/server").catch(() => ({ storage: null }));
  const alert = $("storage-alert");
  alert.hidden = !status.storage;
  alert.textContent = status.storage
    ? `El disco del servidor no admite más escrituras (no se guarda nada nuevo): ${status.storage.message}`
    : "";
  alert.dataset.checked = "true";
}

$("login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("login-error").textContent = "";
  try {
    const member = await api("POST", "/api/login", {
      name: $("login-name").value.trim(),
      password: $("login-password").value,
    });
    $("login-password").value = "";
    await showApp(member);
  } catch (error) {
    $("login-error").textContent = error.status === 401 ? "Nombre o contraseña incorrectos."
      : error.status === 507 ? "El disco del servidor está lleno: no se puede entrar hasta que haya espacio."
      : error.message;
  }
});

async function logout() {
  stopAnswer();
  await api("POST", "/api/logout").catch(() => {});
  $("conversations").replaceChildren();
  $("messages").replaceChildren();
  showLogin();
}

$("logout").addEventListener("click", logout);

// --- password change -----------------------------------------------------------------------------
// Required after logging in with a password an admin set (the account is provisional until then: the
// server answers nothing else); any member can also reach it from the sidebar.

const PASSWORD_FIELDS = ["password-current", "password-new", "password-repeat"];
const clearPasswordFields = () => PASSWORD_FIELDS.forEach((id) => ($(id).value = ""));

const PASSWORD_ERRORS = {
  wrong_password: "La contraseña actual no es correcta.",
  weak_password: "La nueva contraseña es demasiado corta.",
  same_password: "La nueva contraseña tiene que ser distinta de la actual.",
  login_locked: "Demasiados intentos fallidos: espera unos minutos.",
};

function showPassword(required) {
  stopAnswer();
  state.passwordRequired = required;
  $("password-why").textContent = required
    ? "Tu contraseña la eligió quien administra la familia. Elige una tuya para empezar: la anterior y la " +
      "clave de API que te dieron dejarán de funcionar."
    : "";
  $("password-cancel").textContent = required ? "Salir" : "Cancelar";
  clearPasswordFields();
  $("password-error").textContent = "";
  $("password-form").hidden = false;
  $("password-done").hidden = true;
  $("login").hidden = true;
  $("app").hidden = true;
  $("password").hidden = false;
  $("password-current").focus();
}

$("change-password").addEventListener("click", () => showPassword(false));
$("password-cancel").addEventListener("click", () => (state.passwordRequired ? logout() : showApp(state.member)));

$("password-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("password-error").textContent = "";
  if ($("password-new").value !== $("password-repeat").value) {
    $("password-error").textContent = "Las dos contraseñas nuevas no coinciden.";
    return;
  }
  try {
    const changed = await api("POST", "/api/me/password", {
      current: $("password-current").value,
      new: $("password-new").value,
    });
    clearPasswordFields();
    state.member = changed;
    $("new-key").textContent = changed.api_key || "";
    $("new-key-box").hidden = !changed.api_key;
    $("password-form").hidden = true;
    $("password-done").hidden = false;
  } catch (error) {
    $("password-error").textContent = PASSWORD_ERRORS[error.code] || error.message;
  }
});

$("password-continue").addEventListener("click", () => {
  $("new-key").textContent = ""; // shown once: not left in the page
  $("new-key-box").hidden = true;
  showApp(state.member);
});

// --- conversations -------------------------------------------------------------------------------

async function loadConversations() {
  const { data } = await api("GET", "/api/conversations");
  const current = data.find((conversation) => conversation.id === state.current);
  if (current) $("title").textContent = current.title;
  const list = $("conversations");
  list.replaceChildren(...data.map((conversation) => {
    const item = document.createElement("li");
    item.textContent = conversation.title;
    item.dataset.id = conversation.id;
    item.classList.toggle("active", conversation.id === state.current);
    item.addEventListener("click", () => openConversation(conversation.id));
    return item;
  }));
}

function newConversation() {
  stopAnswer();
  state.current = null;
  $("title").textContent = "Nueva conversación";
  $("delete-conversation").hidden = true;
  $("messages").replaceChildren();
  $("chat-error").textContent = "";
  for (const item of $("conversations").children) item.classList.remove("active");
  $("sidebar").classList.remove("open");
  $("input").focus();
}

async function openConversation(id) {
  stopAnswer();
  $("chat-error").textContent = "";
  try {
    const conversation = await api("GET", `/api/conversations/${encodeURIComponent(id)}`);
    state.current = conversation.id;
    $("title").textContent = conversation.title;
    $("delete-conversation").hidden = false;
    $("messages").replaceChildren();
    conversation.messages.forEach((message, index) => {
      const bubble = addMessage(message.role, message.content);
      bubble.dataset.done = "true";
      if (message.role === "assistant") answerShown(bubble, conversation.id, index, message.feedback);
    });
    for (const item of $("conversations").children) item.classList.toggle("active", item.dataset.id === id);
    $("sidebar").classList.remove("open");
  } catch (error) {
    $("chat-error").textContent = error.message;
  }
}

$("new-conversation").addEventListener("click", newConversation);
$("menu").addEventListener("click", () => $("sidebar").classList.toggle("open"));
$("delete-conversation").addEventListener("click", async () => {
  if (!state.current || !confirm("¿Borrar esta conversación?")) return;
  await api("DELETE", `/api/conversations/${encodeURIComponent(state.current)}`).catch((error) => {
    $("chat-error").textContent = error.message;
  });
  newConversation();
  await loadConversations();
});

// --- sending and streaming -----------------------------------------------------------------------

function addMessage(role, text) {
  const bubble = document.createElement("div");
  bubble.className = `message ${role}`;
  bubble.textContent = text;
  $("messages").append(bubble);
  bubble.scrollIntoView({ block: "end" });
  return bubble;
}

// An answer the server has stored: feedback.js puts its 👍 / 👎 / "Mejorar" under it. index: its place
// among the conversation's messages (the server's numbering), feedback: the member's rating, if any.
function answerShown(bubble, conversation, index, feedback) {
  bubble.dataset.index = index;
  const detail = { bubble, conversation, index, feedback: feedback || null };
  document.dispatchEvent(new CustomEvent("enlace:answer", { detail }));
}

function stopAnswer() {
  if (state.controller) state.controller.abort();
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("input").disabled = busy;
}

$("stop").addEventListener("click", stopAnswer);
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

$("composer").addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  $("chat-error").textContent = "";
  try {
    if (!state.current) {
      const conversation = await api("POST", "/api/conversations", {});
      state.current = conversation.id;
      $("delete-conversation").hidden = false;
    }
  } catch (error) {
    $("chat-error").textContent = error.message;
    return;
  }
  const conversationId = state.current;
  $("input").value = "";
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  try {
    await streamAnswer(conversationId, text, bubble, controller.signal);
  } catch (error) {
    if (error.name !== "AbortError") $("chat-error").textContent = error.message;
  } finally {
    bubble.dataset.done = "true";
    if (bubble.isConnected && bubble.textContent && bubble.dataset.index) {
      answerShown(bubble, conversationId, Number(bubble.dataset.index), null);
    }
    state.controller = null;
    setBusy(false);
    $("input").focus();
    loadConversations().catch(() => {});
  }
});

// Reads the server-sent events of one answer: "data: {json}" blocks separated by a blank line, ending
// with "data: [DONE]". Each chunk's choices[0].delta.content is appended as it arrives.
async function streamAnswer(id, text, bubble, signal) {
  const response = await fetch(`/api/conversations/${encodeURIComponent(id)}/messages`, {
    method: "POST",
    headers: { ...sessionHeaders(), "Content-Type": "application/json" },
    credentials: "same-origin",
    body: JSON.stringify({ content: text, stream: true }),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.message_index !== undefined) bubble.dataset.index = chunk.message_index;
        if (chunk.tool_messages) showToolActions(bubble, chunk.tool_messages);
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          bubble.textContent += delta.content;
          bubble.scrollIntoView({ block: "end" });
        }
      }
    }
  }
}

// --- start -----------------------------------------------------------------------------------------

api("GET", "/api/me").then(showApp, showLogin);
