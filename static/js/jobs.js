// Live job pages: the log and status badges arrive over the websocket (htmx ws extension) as
// out-of-band fragments; polling takes over only while the socket is not open.
(() => {
  "use strict";

  const logOf = (id) => document.getElementById(`job-log-${id}`);

  // The seq of the last line on the page, or -1: where a reconnect or a poll resumes.
  function cursor(id) {
    const log = logOf(id);
    const last = log && log.lastElementChild;
    return last && last.dataset.seq !== undefined ? Number(last.dataset.seq) : -1;
  }

  function live(id) {
    const socket = document.querySelector(`[data-job-socket="${id}"]`);
    return Boolean(socket && socket.dataset.wsOpen === "1");
  }

  // Polling stands in for the socket only while the socket is closed: `data-poll-unless-live="ID"` on the
  // polling element (no trigger filter: htmx runs without eval under the page's Content-Security-Policy).
  document.addEventListener("htmx:beforeRequest", (event) => {
    const id = event.detail.elt.dataset && event.detail.elt.dataset.pollUnlessLive;
    if (id !== undefined && live(id)) event.preventDefault();
  });

  // A poll asks only for the lines after the last one shown: `data-after-cursor="JOB"` (instead of hx-vals
  // with js:, which needs eval).
  document.addEventListener("htmx:configRequest", (event) => {
    const id = event.detail.elt.dataset && event.detail.elt.dataset.afterCursor;
    if (id !== undefined) event.detail.parameters.after = cursor(id);
  });

  document.addEventListener("htmx:wsOpen", (event) => { event.target.dataset.wsOpen = "1"; });
  document.addEventListener("htmx:wsClose", (event) => { delete event.target.dataset.wsOpen; });

  // A line can reach the page twice (a poll and the socket racing): keep the first, in seq order.
  // Follow the end of the log while the reader is there; leave them be when they scrolled up.
  document.addEventListener("htmx:oobBeforeSwap", (event) => {
    const target = event.detail.target;
    if (!target.classList || !target.classList.contains("log")) return;
    const last = cursor(target.dataset.job);
    for (const line of Array.from(event.detail.fragment.children || [])) {
      if (line.dataset && line.dataset.seq !== undefined && Number(line.dataset.seq) <= last) line.remove();
    }
    const atEnd = target.scrollHeight - target.scrollTop - target.clientHeight < 40;
    if (atEnd) requestAnimationFrame(() => { target.scrollTop = target.scrollHeight; });
  });

  // The ws extension reconnects to the URL the page was loaded with; resume from the last line shown.
  if (window.htmx && htmx.createWebSocket) {
    const create = htmx.createWebSocket;
    htmx.createWebSocket = (url) => {
      const match = url.match(/\/ws\/jobs\/(\d+)\//);
      if (match) url = url.replace(/([?&]after=)-?\d+/, `$1${cursor(match[1])}`);
      return create(url);
    };
  }

  // A status badge for a job that is not on the list yet (it was queued after the page loaded): reload the
  // table once, so new jobs appear without a refresh. Only on the first page with no filter that hides it.
  let reloading = false;
  document.addEventListener("htmx:oobErrorNoTarget", (event) => {
    const content = event.detail.content;
    if (!content || !content.id || !content.id.startsWith("job-badge-")) return;
    const table = document.getElementById("job-table");
    if (!table || reloading || new URLSearchParams(location.search).get("page") > 1) return;
    reloading = true;
    htmx.ajax("GET", location.pathname + location.search, { target: "#job-table", swap: "outerHTML" })
      .finally(() => { reloading = false; });
  });

  document.addEventListener("DOMContentLoaded", () => {
    document.querySelectorAll(".log").forEach((log) => { log.scrollTop = log.scrollHeight; });
  });

  window.ramdeckJobs = { cursor, live };
})();
