// The portal's one script: the request form's live estimate. As the fields change it posts
// them to /ui/estimate (a dry-run admission: decided by the same policy as a real request,
// creating no lease and holding no quota) and shows the answer. Every string is set as text,
// never as markup. Without this script the form works the same, with a "Check cost" button.
"use strict";
(function () {
  const form = document.getElementById("request-form");
  const box = document.getElementById("estimate");
  if (!form || !box) {
    return;
  }
  const summary = document.getElementById("estimate-summary");
  const list = document.getElementById("estimate-reasons");
  let timer = null;
  let asked = 0;

  function show(answer) {
    box.className = answer.decision;
    summary.textContent = answer.summary;
    list.replaceChildren();
    for (const reason of answer.reasons || []) {
      const item = document.createElement("li");
      item.dataset.code = reason.code;
      const problem = document.createElement("strong");
      problem.textContent = reason.problem;
      const fix = document.createElement("span");
      fix.className = "fix";
      fix.textContent = reason.fix;
      item.append(problem, " ", fix);
      list.append(item);
    }
  }

  async function refresh() {
    const mine = ++asked;
    const body = new URLSearchParams(new FormData(form));
    body.delete("check");
    try {
      const response = await fetch("/ui/estimate", {
        method: "POST",
        body: body,
        credentials: "same-origin",
        headers: { "Accept": "application/json" },
      });
      const answer = await response.json();
      // An older answer arriving after a newer one is dropped.
      if (mine === asked) {
        show(answer);
      }
    } catch (e) {
      if (mine === asked) {
        show({ decision: "invalid", summary: "The estimate could not be fetched; the form still works.", reasons: [] });
      }
    }
  }

  function later() {
    clearTimeout(timer);
    timer = setTimeout(refresh, 200);
  }

  form.addEventListener("input", later);
  form.addEventListener("change", later);
  // A page that shows the decision of a submitted request keeps it until a field changes.
  if (box.className === "idle") {
    refresh();
  }
})();
