// The chat box of a deployment's run page (templates/deployments/lifecycle/_chat.html).
//
// The conversation is kept here, in the page. Each message posts it whole (JSON) to the console, which asks
// llama-server with the deployment's API key and streams the answer back as server-sent events
// (chat/views.py): {"delta"}, {"reasoning"}, {"error"}, and {"done"} last. Text is only ever set with
// textContent, never parsed as HTML.
(() => {
  const panel = document.getElementById("chat");
  const form = document.getElementById("chat-form");
  if (!panel || !form) return;
  const log = document.getElementById("chat-log");
  const input = document.getElementById("chat-input");
  const send = document.getElementById("chat-send");
  const stop = document.getElementById("chat-stop");
  const clear = document.getElementById("chat-clear");
  const errorBox = document.getElementById("chat-error");
  const unavailable = document.getElementById("chat-unavailable");
  const history = [];
  let controller = null;

  // The state badge is re-rendered from the deployment's websocket: read it each time. Verifying comes after
  // llama-server answered its health check, so the chat opens then (chat/views.py CHAT_STATES).
  const OPEN_STATES = ["verifying", "running", "degraded"];
  const running = () => {
    const badge = document.getElementById("deployment-state");
    // Degraded with llama-server gone is marked data-serving="no": there is nobody to answer.
    const live = Boolean(badge) && OPEN_STATES.some((state) => badge.classList.contains(state));
    return live && badge.dataset.serving !== "no";
  };
  const refresh = () => {
    const open = running();
    input.disabled = !open;
    send.disabled = !open || controller !== null;
    unavailable.hidden = open;
  };
  document.addEventListener("htmx:afterSettle", refresh);
  document.addEventListener("htmx:oobAfterSwap", refresh);
  refresh();

  const showError = (text) => {
    errorBox.textContent = text;
    errorBox.hidden = !text;
  };

  const bubble = (role, text) => {
    const item = document.createElement("div");
    item.className = `chat-message ${role}`;
    const who = document.createElement("div");
    who.className = "chat-who";
    who.textContent = role === "user" ? "You" : panel.dataset.model;
    const body = document.createElement("div");
    body.className = "chat-text";
    body.textContent = text;
    item.append(who, body);
    log.append(item);
    log.scrollTop = log.scrollHeight;
    return item;
  };

  const note = (item, text) => {
    const meta = document.createElement("div");
    meta.className = "chat-meta";
    meta.textContent = text;
    item.append(meta);
  };

  const summary = (event) => {
    const parts = [];
    if (event.tokens != null) parts.push(`${event.tokens} tokens`);
    if (event.tokens_per_s != null) parts.push(`${event.tokens_per_s.toFixed(1)} tokens/s`);
    if (event.finish_reason === "length") parts.push("cut at the console's length limit");
    return parts.join(" · ");
  };

  // Reads the event stream; calls onEvent for each `data:` line's JSON.
  async function readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of block.split("\n")) {
          if (line.startsWith("data:")) onEvent(JSON.parse(line.slice(5)));
        }
      }
    }
  }

  form.addEventListener("submit", async (submitted) => {
    submitted.preventDefault();
    const text = input.value.trim();
    if (!text || controller !== null || !running()) return;
    showError("");
    history.push({ role: "user", content: text });
    const asked = bubble("user", text);
    input.value = "";
    const answer = bubble("assistant", "");
    const answerText = answer.querySelector(".chat-text");
    answer.classList.add("streaming");
    controller = new AbortController();
    stop.hidden = false;
    refresh();
    let reply = "";
    let reasoning = null;
    try {
      const response = await fetch(form.action, {
        method: "POST",
        credentials: "same-origin",
        headers: {
          "Content-Type": "application/json",
          Accept: "text/event-stream",
          "X-CSRFToken": form.querySelector("[name=csrfmiddlewaretoken]").value,
        },
        body: JSON.stringify({ messages: history }),
        signal: controller.signal,
      });
      if (!response.ok) {
        let message = `The console answered ${response.status}.`;
        try {
          message = (await response.json()).error || message;
        } catch {
          // Not JSON (a proxy's error page): the status says enough.
        }
        throw new Error(message);
      }
      await readEvents(response, (event) => {
        if (event.delta) {
          reply += event.delta;
          answerText.textContent = reply;
          log.scrollTop = log.scrollHeight;
        } else if (event.reasoning) {
          if (reasoning === null) {
            reasoning = document.createElement("div");
            reasoning.className = "chat-reasoning";
            answer.insertBefore(reasoning, answerText);
          }
          reasoning.textContent += event.reasoning;
        } else if (event.error) {
          throw new Error(event.error);
        } else if (event.done) {
          const text = summary(event);
          if (text) note(answer, text);
        }
      });
      history.push({ role: "assistant", content: reply });
    } catch (error) {
      if (error.name === "AbortError") {
        note(answer, "stopped");
      } else {
        showError(error.message);
      }
      if (reply) {
        history.push({ role: "assistant", content: reply });
      } else {
        // Nothing came back: take the question out of the conversation and give it back to edit or resend.
        history.pop();
        answer.remove();
        asked.classList.add("failed");
        if (!input.value) input.value = text;
      }
    } finally {
      controller = null;
      stop.hidden = true;
      answer.classList.remove("streaming");
      refresh();
      input.focus();
    }
  });

  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      form.requestSubmit();
    }
  });
  // A phone's keyboard has no Shift+Enter: this button puts a line break where the cursor is.
  document.getElementById("chat-newline")?.addEventListener("click", () => {
    const start = input.selectionStart ?? input.value.length;
    const end = input.selectionEnd ?? start;
    input.setRangeText("\n", start, end, "end");
    input.focus();
  });
  stop.addEventListener("click", () => controller?.abort());
  clear.addEventListener("click", () => {
    controller?.abort();
    history.length = 0;
    log.replaceChildren();
    showError("");
  });
})();
