// The page of `cyclescope serve`: one script, bundled with its libraries by scripts/build-web.
// Every view is a URL (#view?params) that can be shared and reloaded; every view fetches its data
// from the server's JSON routes (cyclescope/web/server.py), which call cyclescope.app.

import flamegraph from 'd3-flame-graph/src/flamegraph.js'
import { select } from 'd3-selection' // the d3-selection d3-flame-graph itself uses: one copy in the bundle
import 'd3-flame-graph/src/flamegraph.css'
import uPlot from 'uplot'
import 'uplot/dist/uPlot.min.css'
import { instance as vizInstance } from '@viz-js/viz'
import './app.css'

const $ = (sel, root = document) => root.querySelector(sel)
const fmt = new Intl.NumberFormat('en-US')
const pct = (x) => (x * 100).toFixed(x >= 0.1 ? 1 : 2) + '%'
const hex = (a) => (a === null || a === undefined) ? '' : '0x' + Number(a).toString(16)

function el (tag, attrs = {}, ...kids) {
  const e = document.createElement(tag)
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue
    if (k === 'class') e.className = v
    else if (k === 'text') e.textContent = v
    else if (k.startsWith('on')) e.addEventListener(k.slice(2), v)
    else e.setAttribute(k, v === true ? '' : v)
  }
  for (const k of kids.flat()) if (k !== null && k !== undefined) e.append(k instanceof Node ? k : String(k))
  return e
}

// --- routing and state ---------------------------------------------------------------------------

const VIEWS = ['overview', 'flame', 'proc', 'diff', 'values', 'stats']
const SEL_KEYS = ['epochs', 'host', 'process', 'image', 'event']

function parseHash () {
  const h = location.hash.replace(/^#\/?/, '')
  const [view, query] = h.split('?')
  return { view: VIEWS.includes(view) ? view : 'overview', params: new URLSearchParams(query || '') }
}

function go (view, params) {
  const p = new URLSearchParams()
  for (const [k, v] of Object.entries(params)) if (v !== '' && v !== null && v !== undefined) p.set(k, v)
  const h = '#/' + view + (p.toString() ? '?' + p : '')
  if (location.hash === h) render(); else location.hash = h
}

function selParams (params) {
  const out = {}
  for (const k of SEL_KEYS) if (params.get(k)) out[k] = params.get(k)
  return out
}

function withSel (params, extra = {}) {
  return { ...selParams(params), ...extra }
}

let lastData = null // what the current view shows, for its JSON download
let renderSeq = 0

async function api (path, params = {}) {
  const q = new URLSearchParams(params)
  const r = await fetch('/api/' + path + (q.toString() ? '?' + q : ''), { credentials: 'same-origin' })
  let body
  try { body = await r.json() } catch (e) { body = { error: r.status + ' ' + r.statusText } }
  if (!r.ok) throw new Error(body.error || r.statusText)
  return body
}

function downloadUrl (fmtName, params) {
  return '/api/download/' + fmtName + '?' + new URLSearchParams(selParams(params))
}

function downloadJson () {
  if (!lastData) return
  const blob = new Blob([JSON.stringify(lastData, null, 1)], { type: 'application/json' })
  const a = el('a', { href: URL.createObjectURL(blob), download: 'cyclescope-' + parseHash().view + '.json' })
  document.body.append(a); a.click(); a.remove()
}

function downloads (params, stacks) {
  const box = el('span', { class: 'downloads' }, 'Download: ',
    el('a', { href: '#', onclick: (e) => { e.preventDefault(); downloadJson() }, title: 'what this view shows, as JSON' }, 'JSON'))
  if (stacks) {
    for (const f of ['collapsed', 'speedscope', 'pprof']) {
      box.append(' · ', el('a', { href: downloadUrl(f, params), title: 'the selection\'s stacks as ' + f }, f))
    }
  }
  return box
}

// --- chrome: header, selection, theme, keys -------------------------------------------------------

function theme (t) {
  const want = t || localStorage.getItem('cyclescope-theme') ||
    (matchMedia('(prefers-color-scheme: dark)').matches ? 'dark' : 'light')
  document.documentElement.dataset.theme = want
  localStorage.setItem('cyclescope-theme', want)
}

function header (view, params) {
  const nav = el('nav', {},
    ...[['overview', 'Overview', '1'], ['flame', 'Flame graph', '2'], ['diff', 'Diff', '3'], ['values', 'Values', '4'], ['stats', 'Stats', '5']]
      .map(([v, label, key]) => el('a', {
        href: '#/' + v + '?' + new URLSearchParams(selParams(params)),
        class: v === view || (view === 'proc' && v === 'overview') ? 'active' : '',
        title: label + ' (key ' + key + ')'
      }, label)))
  const form = el('form', { class: 'selection', onsubmit: (e) => {
    e.preventDefault()
    const p = Object.fromEntries(new URLSearchParams(parseHash().params))
    for (const k of SEL_KEYS) {
      const v = form.elements[k].value.trim()
      if (v) p[k] = v; else delete p[k]
    }
    go(view, p)
  } })
  for (const [k, ph, title] of [['epochs', 'all', 'epochs: all, latest, 3, 2-5, 1,4'], ['host', 'every host', 'hosts, comma-separated'],
    ['process', 'every process', 'commands, comma-separated'], ['image', 'every image', 'images (path or name), comma-separated'],
    ['event', 'every event', 'events, comma-separated']]) {
    form.append(el('label', { title }, k, el('input', { name: k, value: params.get(k) || '', placeholder: ph, size: k === 'epochs' ? 6 : 10 })))
  }
  form.append(el('button', { type: 'submit' }, 'Apply'))
  const themeBtn = el('button', { class: 'theme', title: 'light or dark (key t)', onclick: () => theme(document.documentElement.dataset.theme === 'dark' ? 'light' : 'dark') }, '◐')
  return el('header', {}, el('a', { class: 'brand', href: '#/overview' }, 'cyclescope'), nav, form, themeBtn)
}

function notes (list) {
  if (!list || !list.length) return null
  return el('ul', { class: 'notes' }, list.map((n) => el('li', {}, n)))
}

function error (e) {
  return el('div', { class: 'error', role: 'alert' }, String(e.message || e))
}

function table (cols, rows, opts = {}) {
  const t = el('table', { class: opts.class || 'data' })
  t.append(el('thead', {}, el('tr', {}, cols.map((c) => el('th', { class: c.num ? 'num' : '', title: c.title || null }, c.label)))))
  const body = el('tbody')
  for (const r of rows) {
    const tr = el('tr', opts.rowAttrs ? opts.rowAttrs(r) : {})
    for (const c of cols) {
      const v = c.get(r)
      tr.append(el('td', { class: c.num ? 'num' : (c.class || ''), title: c.tip ? c.tip(r) : null }, v instanceof Node ? v : (v ?? '')))
    }
    body.append(tr)
  }
  t.append(body)
  return t
}

function bar (share) {
  return el('span', { class: 'bar', style: `width:${Math.max(0, Math.min(1, share)) * 100}%` })
}

// --- overview ------------------------------------------------------------------------------------

// A chart of values over time in the page's colours, with stepped lines; dragging over it selects
// the epochs whose segments overlap the range. ``series`` gives the lines' styles from the colours.
function timeChart (box, { height, label, series, xs, ys, segments, params }) {
  const css = getComputedStyle(document.documentElement)
  const colors = ['--c1', '--c2', '--c3', '--c4'].map((v) => css.getPropertyValue(v).trim())
  const fg = css.getPropertyValue('--fg')
  const opts = {
    width: Math.min(box.clientWidth || 1200, 1400),
    height,
    cursor: { drag: { x: true, y: false } },
    select: { show: true },
    scales: { x: { time: true } },
    axes: [{ stroke: fg }, { stroke: fg, label }],
    series: [{}, ...series({ colors, fg, stepped: uPlot.paths.stepped({ align: 1 }) })],
    hooks: { setSelect: [selectEpochs(segments, params)] }
  }
  // eslint-disable-next-line no-new
  new uPlot(opts, [xs, ...ys], box)
}

// Drag over a chart of time: the epochs whose segments overlap the range.
function selectEpochs (tl, params) {
  return (u) => {
    if (u.select.width < 3) return
    const a = u.posToVal(u.select.left, 'x'); const b = u.posToVal(u.select.left + u.select.width, 'x')
    const eps = [...new Set(tl.filter((t) => t.end >= a && t.start <= b).map((t) => t.epoch))].sort((x, y) => x - y)
    if (eps.length) go('overview', { ...Object.fromEntries(params), epochs: eps.join(',') })
  }
}

// Recordings older than timelines: one step per segment, its samples per second over its time
// span, per host.
function timelineChart (box, data, params) {
  const tl = data.timeline.filter((t) => t.start && t.end > t.start)
  if (!tl.length) { box.append(el('p', { class: 'muted' }, 'No time information in these segments.')); return }
  const hosts = [...new Set(tl.map((t) => t.host))]
  const xs = [...new Set(tl.flatMap((t) => [t.start, t.end]))].sort((a, b) => a - b)
  const ys = hosts.map((h) => xs.map((x) => {
    let v = null
    for (const t of tl) if (t.host === h && t.start <= x && x < t.end) v = (v || 0) + t.samples / (t.end - t.start)
    return v
  }))
  timeChart(box, {
    height: 180,
    label: 'samples/s',
    series: ({ colors, stepped }) => hosts.map((h, i) => ({ label: h, stroke: colors[i % colors.length], width: 1.5, paths: stepped, fill: colors[i % colors.length] + '33' })),
    xs,
    ys,
    segments: tl,
    params
  })
}

// The collector's timeline (100 ms windows per thread), summed per process at the step the
// server picked: CPUs busy (clock events) or samples per step, the total and the busiest processes.
function processChart (box, data, params) {
  const pt = data.processes_over_time
  const val = pt.total.cpus ? 'cpus' : 'samples'
  timeChart(box, {
    height: 200,
    label: val === 'cpus' ? 'CPUs busy' : `samples per ${pt.step_ms} ms`,
    series: ({ colors, fg, stepped }) => [
      { label: 'total', stroke: fg, width: 1, paths: stepped },
      ...pt.series.map((s, i) => ({ label: s.name, stroke: colors[i % colors.length], width: 1.5, paths: stepped, dash: i >= colors.length ? [4, 3] : undefined }))],
    xs: pt.times_ms.map((t) => t / 1000),
    ys: [pt.total[val], ...pt.series.map((s) => s[val])],
    segments: data.timeline,
    params
  })
}

async function overviewView (main, params, seq) {
  const data = await api('overview', selParams(params))
  if (seq !== renderSeq) return
  lastData = data
  const rep = data.procedures
  const s = rep.summary || {}
  const ev = rep.events[0]
  main.append(el('div', { class: 'toolbar' }, el('h1', {}, 'Where the cycles went'), downloads(params, true)))
  const lost = (s.lost_records || 0) + (s.lost_samples || 0)
  main.append(el('p', { class: 'summary' },
    `${data.db} · epochs ${(s.epochs || []).join(', ') || 'none'} · hosts ${(s.hosts || []).join(', ') || 'none'} · `,
    ...rep.events.map((e) => `${e} ${fmt.format(rep.totals[e])} samples · `),
    `lost ${fmt.format(lost)} · unknown ${fmt.format(s.unknown_samples || 0)} (${pct(s.unknown_share || 0)})`))
  main.append(notes([...(data.warnings || []), ...(data.notes || [])].filter((x, i, a) => a.indexOf(x) === i)) || '')
  const chart = el('div', { class: 'chart', id: 'timeline' })
  const pt = data.processes_over_time
  const title = pt ? (pt.total.cpus ? 'CPUs busy over time, by process ' : 'Samples over time, by process ') : 'Samples over time '
  main.append(el('h2', {}, title, el('small', {}, 'drag to select the epochs of a time range')), chart)
  if (pt) processChart(chart, data, params)
  else timelineChart(chart, data, params)
  const epochs = el('div', { class: 'epochs' }, 'Epochs: ',
    el('a', { href: '#/overview?' + new URLSearchParams({ ...selParams(params), epochs: 'all' }) }, 'all'),
    ...data.epochs.map((e) => [' · ', el('a', { href: '#/overview?' + new URLSearchParams({ ...selParams(params), epochs: String(e.epoch) }), title: 'hosts: ' + e.hosts.join(', ') }, String(e.epoch) + (e.name ? ' ' + e.name : ''))]).flat())
  main.append(epochs)
  const grid = el('div', { class: 'grid' })
  const procCols = [
    { label: 'Procedure', get: (r) => el('a', { href: '#/proc?' + new URLSearchParams(withSel(params, { name: r.procedure, image: r.image })), class: 'proc' }, r.procedure) },
    ...rep.events.map((e) => ({ label: e, num: true, get: (r) => fmt.format(r.samples[e]), tip: (r) => `${r.samples[e]} samples of ${e}` })),
    { label: '%', num: true, get: (r) => el('span', { class: 'pctcell' }, bar(r.percent[ev] / 100), pct(r.percent[ev] / 100)) },
    { label: 'Image', get: (r) => r.image, class: 'path' }
  ]
  grid.append(el('section', {}, el('h2', {}, 'Procedures'), table(procCols, rep.rows, { class: 'data procs' }),
    rep.not_shown ? el('p', { class: 'muted' }, `${fmt.format(rep.not_shown)} more procedures with fewer samples`) : ''))
  const imgs = data.images
  grid.append(el('section', {}, el('h2', {}, 'Images'), table([
    { label: 'Image', get: (r) => r.image, class: 'path' },
    ...imgs.events.map((e) => ({ label: e, num: true, get: (r) => fmt.format(r.samples[e]) })),
    { label: '%', num: true, get: (r) => pct(r.percent[imgs.events[0]] / 100) }
  ], imgs.rows)))
  main.append(grid)
  if (!data.has_stacks) main.append(el('p', { class: 'muted' }, 'No call stacks in this selection: the flame graph shows one frame per procedure (record with -g fp or -g dwarf).'))
}

// --- flame graphs --------------------------------------------------------------------------------

let chart = null

function label (d) {
  const total = d.data.name === 'all' ? d.value : (chart && chart._rootValue) || d.value
  return `${d.data.name}\n${fmt.format(d.value)} samples (${pct(d.value / total)} of the selection)`
}

function drawFlame (box, tree, opts) {
  const width = Math.max(600, box.clientWidth || 1200)
  const c = flamegraph()
    .width(width)
    .cellHeight(18)
    .transitionDuration(0)
    .minFrameSize(1)
    .inverted(!!opts.icicle)
    .sort(false) // the server sends children in name order
    .label(opts.label || label)
  if (opts.color) c.setColorMapper(opts.color)
  c._rootValue = tree.value
  // A zoom redraws the frames (and their classes): the search's marks go back on after it.
  c.onClick((d) => { if (opts.onClick) opts.onClick(d); highlight() })
  box.replaceChildren()
  const t0 = performance.now()
  select(box).datum(tree).call(c)
  highlight()
  performance.measure('flame:draw', { start: t0 })
  return c
}

function prunedNote (tree) {
  const p = tree.pruned
  if (!p || !p.frames) return null
  return `${fmt.format(p.frames)} of ${fmt.format(p.of)} frames, each of at most ${fmt.format(p.largest)} samples (${pct(p.largest / Math.max(1, tree.value))}), are left out so that the graph stays fast; their time shows in their callers. Callers and callees of one function show all of its frames.`
}

// Search marks the matching frames drawn with a class, and says what share of the samples they
// hold. The graph's own search redraws every frame (about 100 ms for 2,000 frames here) and compiles
// the term once per frame; this compiles it once, and takes a term that is not a valid regular
// expression literally.
let searchTerm = ''
let searchRe = null

function setSearch (term) {
  searchTerm = term || ''
  searchRe = null
  if (!searchTerm) return
  try { searchRe = new RegExp(searchTerm) } catch (e) { searchRe = new RegExp(searchTerm.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')) }
}

function highlight () {
  for (const g of document.querySelectorAll('.flame g.frame')) {
    const name = g.getAttribute('name')
    g.classList.toggle('match', !!searchRe && !!name && name !== 'all' && searchRe.test(name))
  }
}

function matchedShare (tree) {
  // Samples under the outermost matching frames, of the whole tree's.
  let sum = 0
  const todo = [...(tree.children || [])]
  while (todo.length) {
    const n = todo.pop()
    if (searchRe.test(n.name)) sum += n.value; else todo.push(...(n.children || []))
  }
  return sum / Math.max(1, tree.value)
}

function searchFlame (term) {
  const t0 = performance.now()
  setSearch(term)
  highlight()
  const info = $('#searchinfo')
  if (info) info.textContent = searchRe && lastData && lastData.tree ? `matches ${pct(matchedShare(lastData.tree))} of the samples` : ''
  performance.measure('flame:search', { start: t0 })
}

function findNode (root, name) {
  // The outermost frames named `name`, and each one's path from the root.
  const out = []
  const walk = (n, path) => {
    if (n.name === name) { out.push({ node: n, path }); return }
    for (const k of n.children || []) walk(k, path.concat([n.name]))
  }
  for (const k of root.children || []) walk(k, [])
  return out
}

function mergeInto (dst, src) {
  dst.value += src.value
  for (const k of src.children || []) {
    let d = dst.children.find((x) => x.name === k.name)
    if (!d) { d = { name: k.name, value: 0, children: [] }; dst.children.push(d) }
    mergeInto(d, k)
  }
}

function sandwich (root, name) {
  // Callees: every subtree of `name` merged; callers: the paths that lead to it, reversed.
  const hits = findNode(root, name)
  const callees = { name, value: 0, children: [] }
  const callers = { name, value: 0, children: [] }
  for (const { node, path } of hits) {
    mergeInto(callees, node)
    callers.value += node.value
    let at = callers
    for (const f of path.slice().reverse()) {
      let d = at.children.find((x) => x.name === f)
      if (!d) { d = { name: f, value: 0, children: [] }; at.children.push(d) }
      d.value += node.value
      at = d
    }
  }
  return { callers: sortTree(callers), callees: sortTree(callees) }
}

function sortTree (root) {
  // Children in name order, as the server sends its trees (the graph does not sort at each redraw).
  const todo = [root]
  while (todo.length) {
    const n = todo.pop()
    n.children.sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0))
    todo.push(...n.children)
  }
  return root
}

// A frame with a listing: a native procedure (not [unknown], image+offset, or a Python function,
// whose frames name code objects, not instructions).
function hasListing (name) {
  return !/^\[|\+0x[0-9a-f]+$/.test(name) && !name.startsWith('py::')
}

function frameDetails (box, d, params, tree) {
  const name = d.data.name
  box.replaceChildren()
  if (name === 'all') return
  const isProc = hasListing(name)
  box.append(el('strong', {}, name), ` ${fmt.format(d.value)} samples (${pct(d.value / tree.value)}) · `,
    isProc ? el('a', { href: '#/proc?' + new URLSearchParams(withSel(params, { name })), class: 'open-listing' }, 'Listing, CPI and values') : '',
    isProc ? ' · ' : '',
    el('a', { href: '#/flame?' + new URLSearchParams({ ...Object.fromEntries(params), sandwich: name }) }, 'Callers and callees'),
    ' (double-click a frame to open its listing)')
}

async function flameView (main, params, seq) {
  const sw = params.get('sandwich')
  // For one function's callers and callees, the server keeps the stacks through it only: at full
  // resolution however narrow the function is in the whole graph.
  const q = sw ? { ...selParams(params), focus: sw } : selParams(params)
  if (params.get('max_nodes')) q.max_nodes = params.get('max_nodes') // frames drawn at most (default 20,000)
  const lines = params.get('lines') === '1'
  if (lines) q.lines = '1' // Python functions' frames by line (py::f:/path/x.py:13)
  const data = await api('flame', q)
  if (seq !== renderSeq) return
  lastData = data
  const icicle = params.get('icicle') === '1'
  const tools = el('div', { class: 'toolbar' },
    el('h1', {}, sw ? `Callers and callees of ${sw}` : (icicle ? 'Icicle graph' : 'Flame graph')),
    el('label', { title: 'search frames (key /); Esc clears' }, 'Search ', el('input', { id: 'search', type: 'search', placeholder: 'function or regex', value: params.get('search') || '', oninput: (e) => searchFlame(e.target.value) }), el('span', { id: 'searchinfo', class: 'muted' })),
    el('button', { title: 'show the whole graph again (key Esc)', onclick: () => chart && chart.resetZoom() }, 'Reset zoom'),
    el('a', { href: '#/flame?' + new URLSearchParams({ ...Object.fromEntries(params), icicle: icicle ? '' : '1' }), title: 'key i' }, icicle ? 'Flame' : 'Icicle'),
    sw ? el('a', { href: '#/flame?' + new URLSearchParams({ ...Object.fromEntries(params), sandwich: '' }) }, 'Whole graph') : '',
    data.python || lines
      ? el('a', { id: 'python-lines', href: '#/flame?' + new URLSearchParams({ ...Object.fromEntries(params), lines: lines ? '' : '1', sandwich: '' }), title: 'Python functions as one frame, or one frame per line' }, lines ? 'Python functions' : 'Python lines')
      : '',
    downloads(params, true))
  main.append(tools)
  main.append(el('p', { class: 'summary' }, `${data.event}: ${fmt.format(data.tree.value)} samples`,
    data.events.length > 1 ? ` · events: ${data.events.join(', ')} (choose with the event field)` : ''))
  main.append(notes([data.note, prunedNote(data.tree), ...(data.skipped || [])].filter(Boolean)) || '')
  const details = el('div', { class: 'details', id: 'details' }, 'Click a frame to zoom; double-click to open its listing.')
  main.append(details)
  const onClick = (d) => frameDetails(details, d, params, data.tree)
  if (sw) {
    const { callers, callees } = sandwich(data.tree, sw)
    if (!callers.value) { main.append(error(new Error(`no frame named ${sw} in this selection`))); return }
    const a = el('div', { class: 'flame', id: 'callers' }); const b = el('div', { class: 'flame', id: 'callees' })
    main.append(el('h2', {}, 'Callers (the function at the bottom, its callers above it)'), a, el('h2', {}, 'Callees'), b)
    drawFlame(a, callers, { icicle: false, onClick })
    chart = drawFlame(b, callees, { icicle: true, onClick })
  } else {
    const box = el('div', { class: 'flame', id: 'flame' })
    main.append(box)
    chart = drawFlame(box, data.tree, { icicle, onClick })
    box.addEventListener('dblclick', (e) => {
      const g = e.target.closest('g.frame')
      const name = g && g.getAttribute('name')
      if (name && name !== 'all' && !/^\[/.test(name) && !name.startsWith('py::')) go('proc', withSel(params, { name }))
    })
  }
  if (params.get('search')) searchFlame(params.get('search'))
}

// --- differential flame graph and diff table -----------------------------------------------------

function diffColor (d) {
  const delta = d.data.delta || 0
  if (!delta) return 'var(--neutral)'
  const share = Math.min(1, Math.abs(delta) / Math.max(1, d.value || 1))
  const t = 0.35 + 0.65 * share
  return delta > 0 ? `rgba(220, 40, 40, ${t})` : `rgba(40, 90, 220, ${t})`
}

async function diffView (main, params, seq) {
  const a = params.get('a') || '-2'
  const b = params.get('b') || '-1'
  const split = (spec) => { const [ep, host] = spec.split('@'); return { epochs: ep, host: host || '' } }
  const sides = {}
  for (const [k, spec] of [['a', a], ['b', b]]) {
    const s = split(spec)
    for (const key of ['process', 'image']) if (params.get(key)) s[key] = params.get(key)
    for (const [kk, v] of Object.entries(s)) if (v) sides[k + '.' + kk] = v
  }
  if (params.get('event')) sides.event = params.get('event')
  const form = el('form', { class: 'toolbar', onsubmit: (e) => { e.preventDefault(); go('diff', { ...Object.fromEntries(params), a: form.elements.a.value, b: form.elements.b.value }) } },
    el('h1', {}, 'Diff'),
    el('label', { title: 'EPOCHS[@HOST]; -1 is the latest epoch' }, 'A ', el('input', { name: 'a', value: a, size: 8 })),
    el('label', { title: 'EPOCHS[@HOST]' }, 'B ', el('input', { name: 'b', value: b, size: 8 })),
    el('button', { type: 'submit' }, 'Compare'))
  main.append(form)
  const [tree, table_] = await Promise.all([api('flame/diff', sides), api('diff', sides)])
  if (seq !== renderSeq) return
  lastData = { flame: tree, diff: table_ }
  form.append(downloads(params, false))
  const tot = tree.tree.totals
  main.append(el('p', { class: 'summary' }, `${tree.event}: A ${fmt.format(tot.a)} samples, B ${fmt.format(tot.b)} samples. Widths are B's; `,
    el('span', { class: 'swatch up' }), ' more of B\'s samples, ', el('span', { class: 'swatch down' }), ' fewer, coloured only where significant ',
    `(q < ${tree.alpha}, at least ${(tree.min_change * 100).toFixed(2)} points)`))
  main.append(notes([prunedNote(tree.tree)].filter(Boolean)) || '')
  const details = el('div', { class: 'details', id: 'details' }, 'Hover a frame for its shares in A and B.')
  main.append(details)
  const box = el('div', { class: 'flame', id: 'diffflame' })
  main.append(box)
  chart = drawFlame(box, tree.tree, {
    color: diffColor,
    label: (d) => `${d.data.name}\nA ${fmt.format(d.data.a)} (${pct(d.data.share_a)}) → B ${fmt.format(d.value)} (${pct(d.data.share_b)})` +
      (d.data.delta ? `\nsignificant: q = ${d.data.q.toPrecision(2)}` : '\nnot significant'),
    onClick: (d) => frameDetails(details, d, params, tree.tree)
  })
  const rows = table_.rows.filter((r) => r.significant)
  main.append(el('h2', {}, `Significant changes (${rows.length})`))
  main.append(table([
    { label: 'Procedure', get: (r) => el('a', { href: '#/proc?' + new URLSearchParams({ name: r.procedure, epochs: b.split('@')[0] }) }, r.procedure) },
    { label: 'A', num: true, get: (r) => fmt.format(r.a) },
    { label: 'B', num: true, get: (r) => fmt.format(r.b) },
    { label: 'A %', num: true, get: (r) => r.a_percent.toFixed(2) },
    { label: 'B %', num: true, get: (r) => r.b_percent.toFixed(2) },
    { label: 'change', num: true, get: (r) => el('span', { class: r.delta_percent_points > 0 ? 'up' : 'down' }, (r.delta_percent_points > 0 ? '+' : '') + r.delta_percent_points.toFixed(2) + ' pts') },
    { label: 'q', num: true, get: (r) => r.q.toPrecision(2) },
    { label: 'Image', get: (r) => r.image, class: 'path' }
  ], rows))
}

// --- procedure view ------------------------------------------------------------------------------

// Graphviz lays a graph out in the page's thread, in time that grows faster than the graph: a few
// hundred blocks take under a second, an interpreter's dispatch function (thousands) minutes. Larger
// procedures show their hottest blocks and the edges between them.
const CFG_MAX_BLOCKS = 200

function cfgBlocks (calc) {
  const heat = (b) => b.executions || b.frequency || 0
  const all = calc.blocks.map((b, i) => i)
  if (all.length <= CFG_MAX_BLOCKS) return new Set(all)
  return new Set(all.sort((a, b) => heat(calc.blocks[b]) - heat(calc.blocks[a])).slice(0, CFG_MAX_BLOCKS))
}

function cfgDot (calc, shown) {
  const blocks = calc.blocks
  const maxF = Math.max(1e-9, ...blocks.map((b) => b.executions || b.frequency || 0))
  const lines = ['digraph cfg {', 'node [shape=box, style=filled, fontname="monospace", fontsize=10];', 'edge [fontname="monospace", fontsize=9];']
  blocks.forEach((b, i) => {
    if (!shown.has(i)) return
    const f = b.executions || b.frequency || 0
    const heat = f > 0 ? Math.log1p(f) / Math.log1p(maxF) : 0
    const color = `#ff${Math.round(255 - 170 * heat).toString(16).padStart(2, '0')}${Math.round(255 - 220 * heat).toString(16).padStart(2, '0')}`
    // method "floor": a lower bound (samples / (instructions x MAX_STALL)), not an estimate
    const exec = b.executions !== null && b.executions !== undefined ? (b.method === 'floor' ? '\u2265 ' : '') + fmt.format(Math.round(b.executions)) : '?'
    lines.push(`"b${i}" [label="${hex(b.start)}-${hex(b.end)}\\n${b.instructions.length} insns · ${exec} exec", fillcolor="${color}", tooltip="block ${hex(b.start)}: ${exec} executions (${b.method}, ${b.confidence})"];`)
  })
  lines.push('"entry" [shape=oval, style="", label="entry"]; "exit" [shape=oval, style="", label="return"];')
  const edges = calc.edges.filter((e) => (e.src < 0 || shown.has(e.src)) && (e.dst < 0 || shown.has(e.dst)))
  const maxE = Math.max(1e-9, ...edges.map((e) => e.executions || e.frequency || 0))
  for (const e of edges) {
    const v = e.executions || e.frequency || 0
    const w = 0.5 + 4 * (v / maxE)
    const lab = e.executions !== null && e.executions !== undefined ? fmt.format(Math.round(e.executions)) : ''
    const src = e.src < 0 ? 'entry' : 'b' + e.src
    const dst = e.dst < 0 ? 'exit' : 'b' + e.dst
    lines.push(`"${src}" -> "${dst}" [label="${lab}", penwidth=${w.toFixed(2)}, tooltip="${e.kind}: ${lab || 'unknown'}"];`)
  }
  lines.push('}')
  return lines.join('\n')
}

async function drawCfg (box, calc) {
  try {
    const shown = cfgBlocks(calc)
    const viz = await vizInstance()
    const svg = viz.renderSVGElement(cfgDot(calc, shown))
    const kids = [svg]
    if (shown.size < calc.blocks.length) {
      kids.unshift(el('p', { class: 'muted' }, `The ${fmt.format(shown.size)} most executed of ${fmt.format(calc.blocks.length)} blocks, and the edges between them (a graph this large takes Graphviz minutes to lay out).`))
    }
    box.replaceChildren(...kids)
  } catch (e) { box.replaceChildren(error(e)) }
}

const FOLD_OVER = 2000 // rows of a listing before its cold runs are folded
const FOLD_RUN = 40 // the shortest run of rows folded
const FOLD_CONTEXT = 6 // rows kept on each side of a sampled instruction

function foldCold (rows) {
  // The rows as parts, {rows, folded}: runs of at least FOLD_RUN rows further than FOLD_CONTEXT rows
  // from any sampled instruction are folded, in listings of more than FOLD_OVER rows.
  if (rows.length <= FOLD_OVER) return [{ rows, folded: false }]
  const near = new Uint8Array(rows.length)
  rows.forEach((r, i) => {
    if (r.kind === 'insn' && (r.counts || []).some((c) => c > 0)) {
      for (let j = Math.max(0, i - FOLD_CONTEXT); j <= Math.min(rows.length - 1, i + FOLD_CONTEXT); j++) near[j] = 1
    }
  })
  const parts = []
  let i = 0
  while (i < rows.length) {
    let j = i
    while (j < rows.length && near[j] === near[i]) j++
    const run = rows.slice(i, j)
    const folded = !near[i] && run.length >= FOLD_RUN
    const last = parts[parts.length - 1]
    if (!folded && last && !last.folded) last.rows.push(...run); else parts.push({ rows: run, folded })
    i = j
  }
  return parts
}

async function procView (main, params, seq) {
  const name = params.get('name')
  if (!name) { main.append(error(new Error('no procedure named in the URL (name=...)'))); return }
  const q = withSel(params, { name })
  const lst = await api('listing', q)
  if (seq !== renderSeq) return
  lastData = { listing: lst }
  const evs = lst.events
  const ev0 = evs[0]
  main.append(el('div', { class: 'toolbar' }, el('h1', {}, name), el('span', { class: 'path' }, lst.image),
    el('a', { href: '#/flame?' + new URLSearchParams({ ...selParams(params), sandwich: name }) }, 'Callers and callees'),
    downloads(params, false)))
  main.append(el('p', { class: 'summary' }, evs.map((e) => `${e}: ${fmt.format(lst.samples[e])} samples (${pct(lst.samples[e] / Math.max(1, lst.selection_samples[e]))} of the selection)`).join(' · ')))
  main.append(notes([...lst.problems, ...(lst.value_notes || [])]) || '')
  // The listing's instruction rows (the server leaves out `list --json`'s instructions array, which
  // repeats them): counts per event in the order of lst.events.
  const insns = lst.rows.filter((r) => r.kind === 'insn')
  const count = (r, i = 0) => (r.counts || [])[i] || 0
  const hot = insns.filter((r) => count(r) > 0).sort((a, b) => count(b) - count(a)).slice(0, 10)
  main.append(el('h2', {}, 'Hottest instructions'))
  main.append(table([
    { label: 'Address', get: (r) => el('a', { href: '#insn-' + r.address.toString(16), class: 'addr' }, hex(r.address)) },
    ...evs.map((e, i) => ({ label: e, num: true, get: (r) => fmt.format(count(r, i)) })),
    { label: '%', num: true, get: (r) => pct(count(r) / Math.max(1, lst.samples[ev0])) },
    { label: 'Instruction', get: (r) => r.text, class: 'code' },
    { label: 'Source', get: (r) => r.file ? `${r.file.split('/').pop()}:${r.line}` : '' }
  ], hot, { class: 'data hot' }))
  const calcBox = el('section', { class: 'calc' }, el('h2', {}, 'calc: frequency, CPI, culprits'), el('p', { class: 'muted loading' }, 'Running calc (the static model takes a few seconds the first time)…'))
  const cfgBox = el('section', { class: 'cfg' }, el('h2', {}, 'Control-flow graph'), el('p', { class: 'muted' }, 'Waiting for calc…'))
  main.append(calcBox, cfgBox)
  const listBox = el('section', {}, el('h2', {}, 'Annotated listing'))
  main.append(listBox)
  const maxS = insns.reduce((m, r) => Math.max(m, count(r)), 1)
  const valueCols = lst.value_columns || []
  const cols = ['Address', ...evs, 'Exec', 'CPI', 'Culprits', 'Instruction', ...valueCols]
  const t = el('table', { class: 'data listing' }, el('thead', {}, el('tr', {}, cols.map((c, i) => el('th', { class: i > 0 && i <= evs.length + 2 ? 'num' : '' }, c)))))
  const tb = el('tbody')
  let byAddr = null // calc's per instruction, once it has run
  const fillCalc = (tr) => {
    const c = byAddr && byAddr.get(Number(tr.dataset.address))
    if (!c) return
    const exec = tr.querySelector('.exec')
    exec.textContent = c.executions !== null && c.executions !== undefined ? fmt.format(Math.round(c.executions)) : ''
    exec.title = `block executions estimated by calc (${c.confidence} confidence)`
    tr.querySelector('.cpi').textContent = c.cpi !== null && c.cpi !== undefined ? Number(c.cpi).toFixed(2) : ''
    tr.querySelector('.culprits').textContent = (c.culprits || []).join(', ')
  }
  const rowOf = (r) => {
    if (r.kind === 'insn') {
      const n = (r.counts || [])[0] || 0
      const tr = el('tr', { id: 'insn-' + r.address.toString(16), 'data-address': r.address, class: n ? 'sampled' : '' },
        el('td', { class: 'addr' }, hex(r.address)),
        ...evs.map((e, i) => el('td', { class: 'num', title: `${(r.counts || [])[i] || 0} samples of ${e}` }, i === 0 ? [bar(n / maxS), fmt.format(n)] : fmt.format((r.counts || [])[i] || 0))),
        el('td', { class: 'num exec' }), el('td', { class: 'num cpi' }), el('td', { class: 'culprits' }),
        el('td', { class: 'code' }, r.text),
        ...valueCols.map((_, i) => el('td', { class: 'values' }, (r.values || [])[i] || '')))
      fillCalc(tr)
      return tr
    } else if (r.kind === 'source' || r.kind === 'inline') {
      return el('tr', { class: 'src' }, el('td', { colspan: cols.length }, r.file ? `${r.file.split('/').pop()}:${r.line}  ` : '', r.text))
    }
    return el('tr', { class: 'gap' }, el('td', { colspan: cols.length }, r.text || r.note || '…'))
  }
  // A browser lays out a table of tens of thousands of rows in seconds: in a large procedure, long
  // runs of rows far from any sample are folded into one row that opens on a click.
  for (const part of foldCold(lst.rows)) {
    if (!part.folded) { for (const r of part.rows) tb.append(rowOf(r)); continue }
    const n = part.rows.filter((r) => r.kind === 'insn').length
    const tr = el('tr', { class: 'gap folded', title: 'show them' }, el('td', { colspan: cols.length },
      el('a', { href: '#', onclick: (e) => { e.preventDefault(); tr.replaceWith(...part.rows.map(rowOf)) } },
        `${fmt.format(n)} instructions without samples (${hex(part.rows.find((r) => r.kind === 'insn')?.address || 0)}…): show`)))
    tb.append(tr)
  }
  t.append(tb)
  listBox.append(t)
  performance.measure('proc:listing', { start: window.__viewStart || 0 })
  try {
    const calc = await api('calc', q)
    if (seq !== renderSeq) return
    lastData.calc = calc
    calcBox.replaceChildren(el('h2', {}, 'calc: frequency, CPI, culprits'),
      el('pre', { class: 'figure4' }, (calc.summary_text || []).join('\n')), notes(calc.notes) || '')
    byAddr = new Map()
    for (const b of calc.blocks) for (const i of b.instructions) byAddr.set(i.address, { ...i, executions: b.executions, confidence: b.confidence })
    for (const tr of tb.querySelectorAll('tr[data-address]')) fillCalc(tr)
    drawCfg(cfgBox.appendChild(el('div', { class: 'graph' })), calc).then(() => cfgBox.querySelector('.muted')?.remove())
  } catch (e) {
    calcBox.replaceChildren(el('h2', {}, 'calc'), error(e))
    cfgBox.remove()
  }
}

// --- values --------------------------------------------------------------------------------------

async function valuesView (main, params, seq) {
  main.append(el('div', { class: 'toolbar' }, el('h1', {}, 'Values'), downloads(params, false)))
  let inv
  try {
    inv = await api('invariants', selParams(params))
  } catch (e) {
    if (seq !== renderSeq) return
    main.append(error(e)); return
  }
  if (seq !== renderSeq) return
  lastData = { invariants: inv }
  main.append(el('h2', {}, 'Invariants ', el('small', {}, inv.criteria || '')))
  main.append(notes(inv.notes) || '')
  main.append(table([
    { label: 'Where', get: (r) => el('a', { href: '#/proc?' + new URLSearchParams(withSel(params, { name: r.where.split('+')[0] })) }, r.where) },
    { label: 'Instruction', get: (r) => r.insn, class: 'code' },
    { label: 'Kind', get: (r) => r.kind + (r.call_site ? ' @' + r.call_site : '') },
    { label: 'Top value', get: (r) => r.value, class: 'code' },
    { label: 'p', num: true, get: (r) => pct(r.prob), tip: (r) => `at least ${pct(r.prob_low)} (two standard errors below), of ${r.vtot} values` },
    { label: 'Saves ≤', num: true, get: (r) => pct(r.save), tip: () => 'upper estimate of the cycles specializing it could remove, as a share of all samples' },
    { label: 'Source', get: (r) => r.source }
  ], inv.invariants))
  const specBox = el('section', {}, el('h2', {}, 'Specialization opportunities'),
    el('button', { id: 'run-specialize', onclick: async () => {
      specBox.querySelector('button').disabled = true
      specBox.append(el('p', { class: 'muted' }, 'Running specialize over the hottest procedures…'))
      try {
        const sp = await api('specialize', selParams(params))
        lastData.specialize = sp
        specBox.querySelector('p.muted')?.remove()
        const c = sp.counts
        specBox.append(el('p', {}, `${fmt.format(c.instructions)} instructions, ${fmt.format(c.candidates)} candidates, ${fmt.format(c.kept)} kept by static elimination (the straightforward profiler: ${fmt.format(c.loads)} loads)`))
        specBox.append(notes(sp.notes) || '')
        specBox.append(table([
          { label: 'Where', get: (r) => r.where },
          { label: 'What', get: (r) => r.what + ' (' + r.kind + ')', class: 'code' },
          { label: 'Value', get: (r) => String(r.value), class: 'code' },
          { label: 'p', num: true, get: (r) => pct(r.prob), tip: (r) => `± ${pct(r.se)} (one standard error), of ${r.observed} values` },
          { label: 'Saves', num: true, get: (r) => pct(r.share), tip: (r) => `net ${r.net.toFixed(1)} (rule 1), ${r.folded} instructions folded` },
          { label: 'Source', get: (r) => r.source }
        ], sp.opportunities))
      } catch (e) { specBox.append(error(e)) }
    } }, 'Find opportunities (runs calc on the hottest procedures)'))
  main.append(specBox)
}

// --- stats ---------------------------------------------------------------------------------------

async function statsView (main, params, seq) {
  const by = params.get('by') || 'epoch'
  const q = { ...selParams(params), by }
  if (params.get('normalize')) q.normalize = '1'
  main.append(el('div', { class: 'toolbar' }, el('h1', {}, 'Stats across ' + by + 's'),
    el('a', { href: '#/stats?' + new URLSearchParams({ ...Object.fromEntries(params), by: by === 'epoch' ? 'host' : 'epoch' }) }, 'by ' + (by === 'epoch' ? 'host' : 'epoch')),
    el('a', { href: '#/stats?' + new URLSearchParams({ ...Object.fromEntries(params), normalize: params.get('normalize') ? '' : '1' }) }, params.get('normalize') ? 'raw counts' : 'shares (normalized)')))
  let data
  try { data = await api('stats', q) } catch (e) { if (seq === renderSeq) main.append(error(e)); return }
  if (seq !== renderSeq) return
  lastData = data
  main.querySelector('.toolbar').append(downloads(params, false))
  const rows = data.rows || []
  const sets = (data.sets || []).map((x) => x.name)
  const chartBox = el('div', { class: 'chart', id: 'statschart' })
  main.append(el('p', { class: 'summary' }, `${data.event}: ${sets.length} sets, ${rows.length} procedures; sorted by range% (the most variable first)`), chartBox)
  const top = rows.slice(0, 8)
  const css = getComputedStyle(document.documentElement)
  const palette = ['--c1', '--c2', '--c3', '--c4', '--c5', '--c6', '--c7', '--c8'].map((v) => css.getPropertyValue(v).trim())
  // eslint-disable-next-line no-new
  new uPlot({
    width: Math.min(chartBox.clientWidth || 1200, 1400), height: 220,
    scales: { x: { time: false } },
    axes: [{ stroke: css.getPropertyValue('--fg'), values: (u, ticks) => ticks.map((t) => sets[t] ?? '') }, { stroke: css.getPropertyValue('--fg') }],
    series: [{}, ...top.map((r, i) => ({ label: r.procedure, stroke: palette[i], width: 1.5, points: { show: true } }))]
  }, [sets.map((_, i) => i), ...top.map((r) => sets.map((n) => r.per_set[n]))], chartBox)
  main.append(table([
    { label: 'Procedure', get: (r) => r.procedure },
    { label: 'range%', num: true, get: (r) => Number(r.range_percent).toFixed(1) },
    { label: 'sum', num: true, get: (r) => fmt.format(r.sum) },
    { label: 'N', num: true, get: (r) => r.n },
    { label: 'mean', num: true, get: (r) => fmt.format(Math.round(r.mean)) },
    { label: 'std-dev', num: true, get: (r) => fmt.format(Math.round(r.std_dev)) },
    { label: 'sum%', num: true, get: (r) => r.sum_percent.toFixed(2) },
    { label: 'min', num: true, get: (r) => fmt.format(r.min) },
    { label: 'max', num: true, get: (r) => fmt.format(r.max) }
  ], rows.slice(0, 200)))
  main.append(notes(data.left_out) || '')
}

// --- main ----------------------------------------------------------------------------------------

const RENDER = { overview: overviewView, flame: flameView, proc: procView, diff: diffView, values: valuesView, stats: statsView }

async function render () {
  const seq = ++renderSeq
  const { view, params } = parseHash()
  window.__viewStart = performance.now()
  chart = null
  lastData = null
  const root = $('#app')
  const main = el('main', { 'aria-busy': 'true' })
  root.replaceChildren(header(view, params), main)
  document.title = 'cyclescope · ' + view + (params.get('name') ? ' · ' + params.get('name') : '')
  try {
    await RENDER[view](main, params, seq)
  } catch (e) {
    if (seq === renderSeq) main.append(error(e))
  }
  if (seq === renderSeq) {
    main.setAttribute('aria-busy', 'false')
    performance.measure('view:' + view, { start: window.__viewStart })
    document.body.dataset.rendered = String(seq)
  }
}

document.addEventListener('keydown', (e) => {
  const typing = ['INPUT', 'TEXTAREA', 'SELECT'].includes(document.activeElement?.tagName)
  if (e.key === 'Escape') {
    if (typing) document.activeElement.blur()
    const s = $('#search'); if (s) { s.value = ''; searchFlame('') }
    if (chart) chart.resetZoom()
    return
  }
  if (typing || e.ctrlKey || e.metaKey || e.altKey) return
  const { view, params } = parseHash()
  if (e.key === '/') { const s = $('#search'); if (s) { e.preventDefault(); s.focus() } } else if (e.key === 't') theme(document.documentElement.dataset.theme === 'dark' ? 'light' : 'dark')
  else if (e.key === 'i' && view === 'flame') go('flame', { ...Object.fromEntries(params), icicle: params.get('icicle') ? '' : '1' })
  else if ('12345'.includes(e.key)) go(['overview', 'flame', 'diff', 'values', 'stats'][Number(e.key) - 1], selParams(params))
})

// New epochs written by a running daemon: the overview of "all" epochs refreshes by itself.
let knownEpochs = null
setInterval(async () => {
  if (document.hidden) return
  try {
    const e = await api('epochs')
    const ids = e.epochs.map((x) => x.epoch).join(',')
    if (knownEpochs !== null && ids !== knownEpochs) {
      const { view, params } = parseHash()
      const banner = el('div', { class: 'banner' }, 'New epochs in the database. ', el('a', { href: '#', onclick: (ev) => { ev.preventDefault(); render() } }, 'Refresh'))
      if (view === 'overview' && !params.get('epochs')) render(); else if (!$('.banner')) document.body.prepend(banner)
    }
    knownEpochs = ids
  } catch (err) { /* the server stopped: say nothing, keep what is shown */ }
}, 5000)

// For scripts that drive the page (bench/serve.py times zoom and search through these).
window.cyclescope = { chart: () => chart, search: searchFlame, render }

theme()
window.addEventListener('hashchange', render)
render()
