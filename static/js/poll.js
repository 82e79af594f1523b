/* Keep server-rendered panels fresh while work runs.
 *
 * Any element with an id, data-poll-url and data-pending="true" is re-fetched every POLL_MS; the response
 * is the same fragment rendered anew and replaces the element. Polling stops once a fragment arrives with
 * data-pending="false" (the probe finished), or when the session is gone (redirect to the login page).
 */
(function () {
  "use strict";
  var POLL_MS = 1500;
  var RETRY_MS = 5000;

  function poll(id) {
    var el = document.getElementById(id);
    if (!el || el.dataset.pending !== "true") return;
    fetch(el.dataset.pollUrl, { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } })
      .then(function (resp) {
        if (resp.redirected || (resp.status >= 400 && resp.status < 500)) {
          throw new Error("polling stopped: HTTP " + resp.status + (resp.redirected ? " (logged out?)" : ""));
        }
        if (!resp.ok) return null; // server hiccup: keep the old panel, try again
        return resp.text();
      })
      .then(function (html) {
        if (html === null) { setTimeout(function () { poll(id); }, RETRY_MS); return; }
        var tpl = document.createElement("template");
        tpl.innerHTML = html.trim();
        var fresh = tpl.content.firstElementChild;
        if (fresh && fresh.id === id) el.replaceWith(fresh);
        setTimeout(function () { poll(id); }, POLL_MS);
      })
      .catch(function (err) {
        if (window.console) console.warn(err);
        if (err instanceof TypeError) setTimeout(function () { poll(id); }, RETRY_MS); // network error
      });
  }

  document.querySelectorAll("[data-poll-url][data-pending='true']").forEach(function (el) {
    if (el.id) setTimeout(function () { poll(el.id); }, POLL_MS);
  });
})();
