// What the assistant did with the server's tools, shown under its answer: searched, computed, the date
// looked up, remembered, looked up in the memories or forgotten (serve/app.py streams the turn's calls and
// results as OpenAI tool messages). A memory remembered or forgotten can be undone from here. Text is
// always inserted with textContent, never as HTML.
"use strict";

const ACTION_WORDS = {
  buscar_web: "Buscado en internet",
  calculadora: "Calculado",
  fecha_hora: "Fecha consultada",
  recordar: "Recordado",
  buscar_recuerdos: "Buscado en tus recuerdos",
  olvidar: "Olvidado",
};
const SAVED = /^Recuerdo (\d+) guardado/;
const FORGOTTEN = /^Recuerdo (\d+) borrado: «[\s\S]*»\.$/;

// undo(): the request that takes the action back (null: nothing to undo).
function undoOf(name, result) {
  const saved = name === "recordar" && SAVED.exec(result);
  if (saved) return () => api("DELETE", `/api/memories/${saved[1]}`);
  const forgotten = name === "olvidar" && FORGOTTEN.exec(result);
  // Brought back while memory.forget_undo_s lasts; after it the server has erased it and answers 404.
  if (forgotten) return () => api("POST", `/api/memories/${forgotten[1]}/restore`);
  return null;
}

function actionLine(call, result) {
  const name = call.function.name;
  let argumentsOf = {};
  try {
    argumentsOf = JSON.parse(call.function.arguments || "{}");
  } catch (_) { /* shown as it is */ }
  const what = Object.values(argumentsOf).join(", ");
  const item = document.createElement("li");
  const text = document.createElement("span");
  const failed = result.startsWith("Error:");
  text.textContent = `${ACTION_WORDS[name] || name}: ${what}` + (name === "calculadora" && !failed ? ` = ${result}` : "")
    + (failed ? " (no se hizo)" : "");
  item.append(text);
  const undo = failed ? null : undoOf(name, result);
  if (undo) {
    const button = document.createElement("button");
    button.className = "link undo";
    button.textContent = "Deshacer";
    button.addEventListener("click", async () => {
      button.disabled = true;
      try {
        await undo();
        button.textContent = "Deshecho";
      } catch (error) {
        button.disabled = false;
        text.textContent += ` (${error.message})`;
      }
    });
    item.append(" ", button);
  }
  return item;
}

// messages: the turn's assistant messages with tool_calls and the tool messages answering them.
function showToolActions(bubble, messages) {
  const results = {};
  for (const message of messages) if (message.role === "tool") results[message.tool_call_id] = message.content || "";
  const list = document.createElement("ul");
  list.className = "tool-actions";
  for (const message of messages) {
    for (const call of message.tool_calls || []) list.append(actionLine(call, results[call.id] || ""));
  }
  if (list.children.length) bubble.after(list);
}
