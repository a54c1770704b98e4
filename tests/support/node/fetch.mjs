// Node's built-in fetch() through the Affidavit broker, configured only by the environment that
// `affidavit env` prints (HTTPS_PROXY, NODE_EXTRA_CA_CERTS, NODE_USE_ENV_PROXY).
//
//   node fetch.mjs undici URL...   installs undici's EnvHttpProxyAgent as the global dispatcher:
//                                  works on every Node with fetch (18+), needs `npm install undici@6`
//   node fetch.mjs builtin URL...  relies on NODE_USE_ENV_PROXY=1 alone (honoured by Node 22.21+
//                                  and 24+; Node 20 ignores it and connects directly)
//
// Prints one JSON array: {status, headers, body} or {error} per URL.
const [mode, ...urls] = process.argv.slice(2);
if (mode === "undici") {
  const { EnvHttpProxyAgent, setGlobalDispatcher } = await import("undici");
  setGlobalDispatcher(new EnvHttpProxyAgent());
} else if (mode !== "builtin") {
  throw new Error(`mode must be "undici" or "builtin", not ${mode}`);
}
const results = [];
for (const url of urls) {
  try {
    const response = await fetch(url, { signal: AbortSignal.timeout(20000) });
    results.push({ status: response.status, headers: Object.fromEntries(response.headers), body: await response.text() });
  } catch (error) {
    results.push({ error: String(error.cause?.code ?? error.cause?.message ?? error.message) });
  }
}
console.log(JSON.stringify(results));
