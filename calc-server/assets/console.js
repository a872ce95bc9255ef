// The calc-server console's only script: live updates. A page whose <body> carries
// data-refresh="SECONDS" re-fetches its own URL that often and replaces its #live region
// with the fresh one (the filter forms stay as the user left them; open <details> stay
// open). Nothing is built from data here: the server renders every value, escaped.
"use strict";
(function () {
  // Errors are collected where a test (or a person, in the devtools) can read them.
  var errors = (window.consoleErrors = []);
  window.addEventListener("error", function (e) {
    errors.push(String(e.message || e));
  });
  window.addEventListener("unhandledrejection", function (e) {
    errors.push("unhandled rejection: " + String(e.reason));
  });
  document.addEventListener("securitypolicyviolation", function (e) {
    errors.push("CSP violation: " + e.violatedDirective + " " + e.blockedURI);
  });

  function start() {
    var body = document.body;
    var seconds = parseInt(body.getAttribute("data-refresh") || "", 10);
    var toggle = document.getElementById("live-toggle");
    var status = document.getElementById("live-status");
    if (!(seconds > 0) || !document.getElementById("live")) {
      return;
    }
    var on = true;
    var busy = false;

    function say(text) {
      if (status) {
        status.textContent = text;
      }
    }

    function openKeys(root) {
      var keys = {};
      root.querySelectorAll("details[open]").forEach(function (d, i) {
        keys[d.getAttribute("data-key") || "#" + i] = true;
      });
      return keys;
    }

    function refresh() {
      if (!on || busy || document.hidden) {
        return;
      }
      busy = true;
      fetch(window.location.href, {
        credentials: "same-origin",
        headers: { Accept: "text/html" },
        cache: "no-store",
      })
        .then(function (resp) {
          if (!resp.ok) {
            throw new Error("HTTP " + resp.status);
          }
          return resp.text();
        })
        .then(function (text) {
          var doc = new DOMParser().parseFromString(text, "text/html");
          var fresh = doc.getElementById("live");
          var live = document.getElementById("live");
          if (!fresh || !live) {
            return;
          }
          var open = openKeys(live);
          live.replaceWith(document.adoptNode(fresh));
          fresh.querySelectorAll("details").forEach(function (d, i) {
            if (open[d.getAttribute("data-key") || "#" + i]) {
              d.open = true;
            }
          });
          say("updated " + new Date().toLocaleTimeString());
        })
        .catch(function (e) {
          say("update failed: " + e.message + "; retrying");
        })
        .then(function () {
          busy = false;
        });
    }

    if (toggle) {
      toggle.addEventListener("click", function () {
        on = !on;
        toggle.setAttribute("aria-pressed", on ? "true" : "false");
        toggle.textContent = on ? "Live updates on" : "Live updates paused";
        if (on) {
          refresh();
        }
      });
    }
    window.setInterval(refresh, seconds * 1000);
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
