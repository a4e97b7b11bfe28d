// "Mis recuerdos": the logged-in member's memories (family/memories.py through serve/app.py's /api/memories routes).
// A panel of its own in the sidebar's #panels; it reloads whenever the app is shown (a login) and empties
// when it is hidden (a logout), so one member never sees what the previous one had on screen. Text is
// always inserted with textContent, never as HTML.
"use strict";

(() => {
  const el = (tag, props = {}, ...children) => {
    const node = Object.assign(document.createElement(tag), props);
    node.append(...children);
    return node;
  };

  // The server's errors are in English; the ones a member can cause here, in Spanish.
  const SPANISH = {
    memory_forbidden: "Solo las personas adultas guardan recuerdos de la familia.",
    memory_not_found: "Ese recuerdo ya no existe o no es tuyo.",
    invalid_memory: "El recuerdo está vacío o es demasiado largo (máximo 500 caracteres).",
    admin_only: "La cuenta de administración no tiene recuerdos.",
  };
  const call = (method, path, body) => api(method, path, body, SPANISH);

  const text = el("textarea", { id: "memory-text", rows: 2, maxLength: 500, placeholder: "Algo que ENLACE debe recordar…" });
  const family = el("input", { id: "memory-family", type: "checkbox" });
  const pinned = el("input", { id: "memory-pinned", type: "checkbox" });
  const form = el("form", { id: "memory-form", className: "memory-form" },
    text,
    el("label", {}, family, " Para toda la familia"),
    el("label", {}, pinned, " Tenerlo siempre presente"),
    el("button", { type: "submit", id: "memory-save" }, "Guardar"));
  const error = el("p", { id: "memories-error", className: "error", role: "alert" });
  const list = el("ul", { id: "memories", className: "memories" });
  const exportLink = jsonDownload(el("a", { id: "memories-export", href: "/api/memories/export", download: "mis-recuerdos.json" },
    "Exportar (JSON)"));
  const deleteAll = el("button", { id: "memories-delete-all", type: "button", className: "link" }, "Borrar todos");
  const panel = el("details", { id: "memories-panel", className: "panel" },
    el("summary", {}, "Mis recuerdos"), form, error, list, el("div", { className: "memory-actions" }, exportLink, deleteAll));

  function item(memory) {
    const tags = [memory.scope === "family" ? `familia (${memory.member})` : "privado"];
    if (memory.pinned) tags.push("siempre presente");
    const row = el("li", { className: "memory" },
      el("span", { className: "memory-text" }, memory.text),
      el("small", { className: "memory-tags" }, ` ${tags.join(" · ")}`));
    row.dataset.id = memory.id;
    if (memory.editable) {
      const edit = el("button", { type: "button", className: "link memory-edit" }, "Editar");
      const forget = el("button", { type: "button", className: "link memory-forget" }, "Olvidar");
      edit.addEventListener("click", () => editing(row, memory));
      forget.addEventListener("click", () => act(() => call("DELETE", `/api/memories/${memory.id}`)));
      row.append(edit, forget);
    }
    return row;
  }

  function editing(row, memory) {
    const input = el("input", { className: "memory-input", value: memory.text, maxLength: 500 });
    const save = el("button", { type: "button", className: "link memory-update" }, "Guardar");
    const cancel = el("button", { type: "button", className: "link" }, "Cancelar");
    save.addEventListener("click", () => act(() => call("PATCH", `/api/memories/${memory.id}`, { text: input.value })));
    cancel.addEventListener("click", () => row.replaceWith(item(memory)));
    row.replaceChildren(input, save, cancel);
    input.focus();
  }

  async function act(action) {
    error.textContent = "";
    try {
      await action();
      await load();
    } catch (e) {
      error.textContent = e.message;
    }
  }

  async function load() {
    error.textContent = "";
    try {
      const { data } = await call("GET", "/api/memories");
      list.replaceChildren(...data.map(item));
      if (!data.length) list.append(el("li", { className: "memory empty" }, "Aún no hay recuerdos."));
    } catch (e) {
      list.replaceChildren();
      error.textContent = e.message;
    }
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const body = { text: text.value, scope: family.checked ? "family" : "private", pinned: pinned.checked };
    act(async () => {
      await call("POST", "/api/memories", body);
      text.value = "";
      family.checked = pinned.checked = false;
    });
  });
  deleteAll.addEventListener("click", () => {
    if (confirm("¿Borrar todos los recuerdos que has guardado?")) act(() => call("DELETE", "/api/memories"));
  });

  document.getElementById("panels").append(panel);
  const app = document.getElementById("app");
  const follow = () => {
    if (app.hidden) {
      list.replaceChildren();
      error.textContent = "";
      panel.open = false;
    } else {
      load();
    }
  };
  new MutationObserver(follow).observe(app, { attributes: true, attributeFilter: ["hidden"] });
  if (!app.hidden) load();
})();
