// Ratings of the assistant's answers and the "Mis valoraciones" panel (family/feedback.py through serve/app.py's
// routes). Under every stored answer (app.js announces each with an "enlace:answer" event): 👍, 👎 and
// "Mejorar" (write the answer you wanted). The panel lists the member's own ratings (export, delete) and
// the setting "Usar mis valoraciones para entrenar": off until the member turns it on; a child's is set by
// an adult of the family, who sees their children's here. It reloads whenever the app is shown (a login)
// and empties when it is hidden (a logout). Text is always inserted with textContent, never as HTML.
"use strict";

(() => {
  const el = (tag, props = {}, ...children) => {
    const node = Object.assign(document.createElement(tag), props);
    node.append(...children);
    return node;
  };

  // The server's errors are in English; the ones a member can cause here, in Spanish.
  const SPANISH = {
    message_not_found: "Esa respuesta ya no está en la conversación.",
    conversation_not_found: "Esa conversación ya no existe.",
    feedback_not_found: "Esa valoración ya no existe.",
    invalid_feedback: "Escribe la respuesta que querías (distinta de la que te dio ENLACE).",
    consent_forbidden: "Lo decide una persona adulta de la familia.",
  };
  const call = (method, path, body) => api(method, path, body, SPANISH);

  // --- under each answer --------------------------------------------------------------------------

  function ratingBar({ bubble, conversation, index, feedback }) {
    const path = `/api/conversations/${encodeURIComponent(conversation)}/messages/${index}/feedback`;
    const up = el("button", { type: "button", className: "link feedback-up", title: "Buena respuesta" }, "👍");
    const down = el("button", { type: "button", className: "link feedback-down", title: "Mala respuesta" }, "👎");
    up.setAttribute("aria-label", "Buena respuesta");
    down.setAttribute("aria-label", "Mala respuesta");
    const improve = el("button", { type: "button", className: "link feedback-improve" }, "Mejorar");
    const error = el("span", { className: "error feedback-error", role: "alert" });
    const wanted = el("p", { className: "feedback-wanted" });
    const bar = el("div", { className: "feedback" }, up, down, improve, error, wanted);
    let current = feedback;

    function show() {
      up.setAttribute("aria-pressed", String(Boolean(current && current.rating === 1)));
      down.setAttribute("aria-pressed", String(Boolean(current && current.rating === -1)));
      wanted.textContent = current && current.better ? `Tu versión: ${current.better}` : "";
      wanted.hidden = !wanted.textContent;
    }

    async function send(body) { // body: the new rating, or null to withdraw it
      error.textContent = "";
      try {
        if (body) {
          current = await call("POST", path, body);
        } else {
          await call("DELETE", path);
          current = null;
        }
        show();
        reloadPanel();
      } catch (e) {
        error.textContent = e.message;
      }
    }

    function rate(rating) {
      if (current && current.rating === rating) return send(null); // pressed again: withdrawn
      return send(current && current.better ? { rating, better: current.better } : { rating });
    }

    function editing() {
      const field = el("textarea", { className: "feedback-better", rows: 4 });
      field.value = (current && current.better) || bubble.textContent; // start from the answer given
      const save = el("button", { type: "button", className: "feedback-save" }, "Guardar");
      const cancel = el("button", { type: "button", className: "link feedback-cancel" }, "Cancelar");
      const editor = el("div", { className: "feedback-editor" },
        el("label", {}, "La respuesta que querías:", field), save, cancel);
      const close = () => { editor.remove(); improve.disabled = false; };
      save.addEventListener("click", async () => {
        await send({ rating: current ? current.rating : -1, better: field.value });
        if (!error.textContent) close();
      });
      cancel.addEventListener("click", close);
      improve.disabled = true;
      bar.after(editor);
      field.focus();
    }

    up.addEventListener("click", () => rate(1));
    down.addEventListener("click", () => rate(-1));
    improve.addEventListener("click", editing);
    show();
    bubble.after(bar);
  }

  document.addEventListener("enlace:answer", (event) => ratingBar(event.detail));

  // --- the panel ------------------------------------------------------------------------------------

  const consent = el("input", { id: "feedback-consent", type: "checkbox" });
  const consentState = el("small", { id: "feedback-consent-state" });
  const children = el("ul", { id: "feedback-children", className: "memories" });
  const error = el("p", { id: "feedback-error", className: "error", role: "alert" });
  const list = el("ul", { id: "feedback-list", className: "memories" });
  const exportLink = jsonDownload(el("a", { id: "feedback-export", href: "/api/feedback/export", download: "mis-valoraciones.json" },
    "Exportar (JSON)"));
  const deleteAll = el("button", { id: "feedback-delete-all", type: "button", className: "link" }, "Borrar todas");
  const panel = el("details", { id: "feedback-panel", className: "panel" },
    el("summary", {}, "Mis valoraciones"),
    el("label", { className: "feedback-consent" }, consent, " Usar mis valoraciones para entrenar"),
    consentState, children, error, list,
    el("div", { className: "memory-actions" }, exportLink, deleteAll));

  const short = (text) => (text.length > 90 ? `${text.slice(0, 90)}…` : text);

  function stateText(view) {
    const state = view.granted ? "Activado" : "Desactivado";
    const me = document.getElementById("member-name").textContent;
    const by = view.set_by && view.set_by !== me ? ` por ${view.set_by}` : "";
    const rule = view.may_change
      ? (view.granted
        ? ". Se usan todas tus valoraciones, también las anteriores; si lo desactivas, ninguna."
        : ". Tus valoraciones no se usan para entrenar.")
      : ". Lo decide una persona adulta de la familia.";
    return state + by + rule;
  }

  function item(feedback) {
    const row = el("li", { className: "memory feedback-item" },
      el("span", {}, feedback.rating === 1 ? "👍 " : "👎 "),
      el("span", { className: "memory-text" }, short(feedback.answer)));
    if (feedback.better) row.append(el("small", { className: "memory-tags" }, ` → ${short(feedback.better)}`));
    const forget = el("button", { type: "button", className: "link feedback-forget" }, "Borrar");
    forget.addEventListener("click", () => act(() => call("DELETE", `/api/feedback/${feedback.id}`)));
    row.append(forget);
    row.dataset.id = feedback.id;
    return row;
  }

  function child(view) {
    const box = el("input", { type: "checkbox", className: "feedback-child-consent", checked: view.granted });
    box.addEventListener("change", () =>
      act(() => call("PUT", `/api/members/${encodeURIComponent(view.name)}/consent`, { granted: box.checked })));
    const by = view.set_by ? ` (lo decidió ${view.set_by})` : "";
    return el("li", { className: "memory feedback-child" }, el("label", {}, box, ` ${view.name}`), el("small", {}, by));
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
      const [view, { data }] = await Promise.all([call("GET", "/api/consent"), call("GET", "/api/feedback")]);
      consent.checked = view.granted;
      consent.disabled = !view.may_change;
      consentState.textContent = stateText(view);
      const kids = view.children || [];
      children.replaceChildren(...(kids.length ? [el("li", { className: "memory" }, "Niños y niñas de la familia:")] : []),
        ...kids.map(child));
      list.replaceChildren(...data.map(item));
      if (!data.length) list.append(el("li", { className: "memory empty" }, "Aún no has valorado ninguna respuesta."));
    } catch (e) {
      list.replaceChildren();
      error.textContent = e.message;
    }
  }

  function reloadPanel() {
    if (!document.getElementById("app").hidden) load();
  }

  consent.addEventListener("change", () => act(() => call("PUT", "/api/consent", { granted: consent.checked })));
  deleteAll.addEventListener("click", () => {
    if (confirm("¿Borrar todas tus valoraciones?")) act(() => call("DELETE", "/api/feedback"));
  });

  document.getElementById("panels").append(panel);
  const app = document.getElementById("app");
  const follow = () => {
    if (app.hidden) {
      list.replaceChildren();
      children.replaceChildren();
      consentState.textContent = "";
      error.textContent = "";
      panel.open = false;
    } else {
      load();
    }
  };
  new MutationObserver(follow).observe(app, { attributes: true, attributeFilter: ["hidden"] });
  if (!app.hidden) load();
})();
