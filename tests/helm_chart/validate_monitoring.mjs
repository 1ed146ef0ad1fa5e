// Validates the chart's ServiceMonitor and PrometheusRule objects against the
// prometheus-operator API as the npm package @kubernetes-models/prometheus-operator
// carries it (generated from prometheus-operator's Go types):
//   1. the package's own validation: types, required fields, enumerations;
//   2. unknown fields: the package lets them through, and so would the API server (it
//      prunes them silently: a misspelt `honorLabel` would just be gone), so every field
//      is looked up in the package's type declarations (.d.ts), following their imports,
//      as `kubectl apply --validate=strict` would against the CRD.
//
//   node validate_monitoring.mjs NODE_MODULES < objects.json
// objects.json: a JSON array of objects. Prints one line per object; exits 1 if any fails.
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const modules = path.resolve(process.argv[2] ?? "node_modules");
const v1 = path.join(modules, "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1");
const kinds = { ServiceMonitor: "ServiceMonitor", PrometheusRule: "PrometheusRule" };

// Type name -> { fields: Map(name -> type text) } or { alias: type text }, read on demand.
const types = new Map();
const parsedFiles = new Set();

function declarationFile(from, specifier) {
  if (specifier.startsWith(".")) {
    return path.resolve(path.dirname(from), specifier.replace(/\.js$/, ".d.ts"));
  }
  return path.join(modules, specifier + ".d.ts");
}

function parse(file) {
  if (parsedFiles.has(file)) return;
  parsedFiles.add(file);
  const text = fs.readFileSync(file, "utf8").replace(/\/\*\*[\s\S]*?\*\//g, "");
  const imports = [];
  for (const m of text.matchAll(/^import \{ ([^}]+) \} from "([^"]+)";$/gm)) {
    if (m[2].startsWith("@kubernetes-models/base")) continue;
    imports.push(declarationFile(file, m[2]));
  }
  // `export declare class X extends Model<IX> ... { fields }`: the class lists every
  // field, the inherited ones too.
  for (const m of text.matchAll(/^export declare class \w+ extends Model<(\w+)>[^{]*\{\n([\s\S]*?)^\}/gm)) {
    const fields = new Map();
    for (const f of m[2].matchAll(/^ {4}"([^"]+)"\??: ([\s\S]*?);\n(?= {4}["a-z]|$)/gm)) {
      fields.set(f[1], f[2]);
    }
    types.set(m[1], { fields });
  }
  for (const m of text.matchAll(/^export type (I\w+) = ([^;]+);$/gm)) {
    if (!types.has(m[1])) types.set(m[1], { alias: m[2] });
  }
  for (const m of text.matchAll(/^export type \{ ([^}]+) \};$/gm)) {
    for (const pair of m[1].split(",")) {
      const [local, exported] = pair.trim().split(/\s+as\s+/);
      if (exported && local.startsWith("I")) types.set(exported, { alias: local });
    }
  }
  for (const next of imports) {
    if (fs.existsSync(next)) parse(next);
  }
}

function resolve(name) {
  let type = types.get(name);
  for (let i = 0; type && type.alias && i < 8; i++) {
    const next = types.get(type.alias.trim());
    if (!next) return { alias: type.alias };
    type = next;
  }
  return type;
}

// Every field of `value` must be one its type declares; recurses into the fields.
function unknownFields(value, typeText, where, errors) {
  if (value === null || value === undefined) return;
  let t = typeText.trim().replace(/\s*\|\s*null$/, "");
  const array = t.match(/^Array<([\s\S]+)>$/);
  if (array) {
    if (Array.isArray(value)) value.forEach((v, i) => unknownFields(v, array[1], `${where}/${i}`, errors));
    return;
  }
  const map = t.match(/^\{\s*\[key: string\]: ([\s\S]+?);?\s*\}$/);
  if (map) {
    if (typeof value === "object") {
      for (const [k, v] of Object.entries(value)) unknownFields(v, map[1], `${where}/${k}`, errors);
    }
    return;
  }
  if (!/^I\w+$/.test(t)) return; // a primitive or a union of them: step 1 checks it
  const type = resolve(t);
  if (!type) {
    errors.push(`${where}: type ${t} not found in the declarations`);
    return;
  }
  if (!type.fields) return unknownFields(value, type.alias, where, errors);
  if (typeof value !== "object" || Array.isArray(value)) return;
  for (const [k, v] of Object.entries(value)) {
    if (!type.fields.has(k)) {
      errors.push(`${where}/${k}: unknown field (${t.replace(/^I(ComGithubPrometheusOperatorPrometheusOperatorPkgApisMonitoringV1|IoK8s\w*V1)?/, "")} has ${[...type.fields.keys()].join(", ")})`);
    } else {
      unknownFields(v, type.fields.get(k), `${where}/${k}`, errors);
    }
  }
}

const objects = JSON.parse(fs.readFileSync(0, "utf8"));
let failed = 0;
for (const object of objects) {
  const kind = kinds[object.kind];
  const name = `${object.kind}/${object.metadata?.name}`;
  if (!kind || object.apiVersion !== "monitoring.coreos.com/v1") {
    console.log(`FAIL ${name}: not a monitoring.coreos.com/v1 ServiceMonitor or PrometheusRule`);
    failed++;
    continue;
  }
  const errors = [];
  const file = path.join(v1, `${kind}.d.ts`);
  parse(file);
  const model = await import(pathToFileURL(path.join(v1, `${kind}.js`)).href);
  try {
    new model[kind](object).validate();
  } catch (e) {
    errors.push(e.message);
  }
  unknownFields(object, `I${kind}`, "", errors);
  if (errors.length) {
    failed++;
    console.log(`FAIL ${name}: ${errors.join("; ")}`);
  } else {
    console.log(`PASS ${name}`);
  }
}
process.exit(failed ? 1 : 0);
