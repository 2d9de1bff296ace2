// The docs page's one script of its own: Swagger UI over this server's /openapi.json.
// Relative URLs, so the page also works behind a proxy that serves the API under a prefix.
"use strict";
window.addEventListener("load", function () {
  window.ui = SwaggerUIBundle({
    url: new URL("openapi.json", document.baseURI).href,
    dom_id: "#swagger-ui",
    deepLinking: true,
    // Never send the document to an outside validator (Swagger UI's default).
    validatorUrl: null,
    presets: [SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
  });
});
