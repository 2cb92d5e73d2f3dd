// Small behaviours shared by every page. htmx does the heavy lifting.

// Copy buttons: <button data-copy="#element-id">Copy</button>
document.addEventListener("click", (event) => {
  const button = event.target.closest("[data-copy]");
  if (!button) return;
  const source = document.querySelector(button.dataset.copy);
  if (!source) return;
  navigator.clipboard.writeText(source.value ?? source.textContent).then(() => {
    const label = button.textContent;
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = label; }, 1500);
  });
});

// Messages fade after a while but stay readable for screen readers until then.
document.addEventListener("DOMContentLoaded", () => {
  setTimeout(() => document.querySelectorAll(".message.success").forEach((el) => el.remove()), 8000);
});
