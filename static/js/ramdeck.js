// Small behaviours shared by every page. htmx does the heavy lifting.

// Copy buttons: <button data-copy="#element-id">Copy</button>
//
// navigator.clipboard exists only in a secure context (https, or loopback). A console opened over plain
// http from another machine of the household (RAMDECK_BIND=0.0.0.0) has none, so the text is copied there
// through a selection in a hidden text box, which browsers still allow on a click.
const copyBySelection = (text) => {
  const buffer = document.createElement("textarea");
  buffer.value = text;
  buffer.readOnly = true;
  buffer.className = "copy-buffer";
  document.body.append(buffer);
  buffer.select();
  let copied = false;
  try {
    copied = document.execCommand("copy");
  } finally {
    buffer.remove();
  }
  return copied ? Promise.resolve() : Promise.reject(new Error("the browser refused to copy"));
};

const copyText = (text) =>
  window.isSecureContext && navigator.clipboard ? navigator.clipboard.writeText(text) : copyBySelection(text);

// Nothing could be copied: the text is selected instead, for the reader's own Ctrl+C.
const selectForCopying = (source) => {
  if (source.select) {
    source.select();
    return;
  }
  const range = document.createRange();
  range.selectNodeContents(source);
  const selection = window.getSelection();
  selection.removeAllRanges();
  selection.addRange(range);
};

document.addEventListener("click", (event) => {
  const button = event.target.closest("[data-copy]");
  if (!button) return;
  const source = document.querySelector(button.dataset.copy);
  if (!source) return;
  const label = button.dataset.label ?? button.textContent;
  button.dataset.label = label;
  const say = (text) => {
    button.textContent = text;
    setTimeout(() => { button.textContent = label; }, 1500);
  };
  copyText(source.value ?? source.textContent).then(
    () => say("Copied"),
    () => {
      selectForCopying(source);
      say("Selected: press Ctrl+C");
    },
  );
});

// Plain forms that ask first: <form data-confirm="Delete this?"> (no inline onsubmit: the page's
// Content-Security-Policy runs no inline event handlers).
document.addEventListener("submit", (event) => {
  const form = event.target.closest("form[data-confirm]");
  if (form && !window.confirm(form.dataset.confirm)) event.preventDefault();
});

// Messages fade after a while but stay readable for screen readers until then.
document.addEventListener("DOMContentLoaded", () => {
  setTimeout(() => document.querySelectorAll(".message.success").forEach((el) => el.remove()), 8000);
});

// The navigation menu on narrow screens. Without this script the links simply stay open (the CSS folds
// them only once `has-menu` is set), so nothing becomes unreachable.
document.addEventListener("DOMContentLoaded", () => {
  const bar = document.getElementById("topbar");
  const toggle = document.getElementById("menu-toggle");
  if (!bar || !toggle) return;
  bar.classList.add("has-menu");
  const setOpen = (open) => {
    bar.classList.toggle("nav-open", open);
    toggle.setAttribute("aria-expanded", String(open));
  };
  toggle.addEventListener("click", () => setOpen(!bar.classList.contains("nav-open")));
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && bar.classList.contains("nav-open")) {
      setOpen(false);
      toggle.focus();
    }
  });
});

// Boxes that scroll sideways (wide tables, long commands) say so: `scrolls-x` shows a shadow and a hint
// at the edge that has more; it is recomputed on scroll, on resize and after htmx swaps new content in.
const SCROLL_BOXES = "table, pre, .log, .table-wrap, .table-scroll";
function markScrollable(root = document) {
  root.querySelectorAll(SCROLL_BOXES).forEach((box) => {
    const more = box.scrollWidth - box.clientWidth;
    box.classList.toggle("scrolls-x", more > 1);
    box.classList.toggle("scrolled-end", more > 1 && box.scrollLeft >= more - 1);
  });
}
document.addEventListener("DOMContentLoaded", () => markScrollable());
window.addEventListener("resize", () => markScrollable());
document.addEventListener("htmx:afterSettle", () => markScrollable());
document.addEventListener(
  "scroll",
  (event) => {
    if (event.target instanceof Element && event.target.matches(SCROLL_BOXES)) markScrollable(event.target.parentElement ?? document);
  },
  true,
);

// Tables marked `cards` become one card per row on a phone (static/css/ramdeck.css); each cell is given
// its column's heading as a label, so a value is never shown without saying what it is.
function labelCardCells(root = document) {
  root.querySelectorAll("table.cards").forEach((table) => {
    const headings = [...table.querySelectorAll("thead th")].map((th) => th.textContent.trim());
    table.querySelectorAll("tbody tr").forEach((row) => {
      [...row.cells].forEach((cell, index) => {
        if (cell.colSpan === 1 && !cell.hasAttribute("data-label")) cell.dataset.label = headings[index] ?? "";
      });
    });
  });
}
document.addEventListener("DOMContentLoaded", () => labelCardCells());
// After a swap the whole page is labelled again: an outerHTML swap's event target may be the replaced element.
document.addEventListener("htmx:afterSettle", () => labelCardCells());

// The Add-a-node form's "Create a credential" link (templates/nodes/node_form.html): posted with the form, so
// what was typed is kept (in the session) while the credential is made. A link, not a submit button, so that
// Enter in a field still adds the node; without JavaScript it opens the credential form, which comes back.
document.addEventListener("click", (event) => {
  const link = event.target instanceof Element ? event.target.closest("#create-credential") : null;
  const form = link?.closest("form");
  if (!form) return;
  event.preventDefault();
  const then = document.createElement("input");
  then.type = "hidden";
  then.name = "then";
  then.value = "credential";
  form.append(then);
  form.submit();
});
