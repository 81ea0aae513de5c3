// The overview refreshes itself and counts the lease down; no other page runs script.
// Task data only ever reaches the page as server-escaped HTML (Jinja2 autoescaping) or as
// textContent, and the Content-Security-Policy lets no inline script run.
"use strict";

(function () {
  const box = document.getElementById("overview");
  if (!box) {
    return;
  }
  const every = Math.max(500, parseInt(box.dataset.refreshMs, 10) || 3000);

  // Each countdown's deadline on this page's monotonic clock, from the seconds the database
  // clock had left when the server read the lease.
  function arm() {
    box.querySelectorAll("[data-expires-in]").forEach(function (el) {
      const left = parseFloat(el.dataset.expiresIn) * 1000;
      el.dataset.deadline = String(performance.now() + left);
    });
    tick();
  }

  function tick() {
    box.querySelectorAll("[data-deadline]").forEach(function (el) {
      const left = (parseFloat(el.dataset.deadline) - performance.now()) / 1000;
      const card = el.closest("#lease");
      if (left > 0) {
        el.textContent = left.toFixed(1) + " s";
        return;
      }
      card.querySelector(".leader").hidden = true;
      card.querySelector(".no-leader").hidden = false;
    });
  }

  async function refresh() {
    try {
      const response = await fetch(box.dataset.src, { credentials: "same-origin" });
      if (response.ok) {
        box.innerHTML = await response.text();
        box.dataset.refreshed = String(Date.now());
        arm();
      }
    } catch (e) {
      // The server is away for a moment: keep what is shown and try again later.
    }
  }

  arm();
  setInterval(tick, 200);
  setInterval(refresh, every);
})();
