-- A training and measuring run for the Lua interpreter in bench/optimize.py: the kinds of work
-- an interpreter's hot paths see (table-heavy allocation and the collector, integer arrays,
-- floating point, closures and method calls, string building and pattern matching).
-- Usage: lua workload.lua [SCALE]   (SCALE 1 runs about 0.3 s at -O2 here)

local scale = tonumber(arg and arg[1]) or 1

-- binary trees: allocation and the garbage collector
local function bottom_up(depth)
  if depth == 0 then return {} end
  depth = depth - 1
  return { bottom_up(depth), bottom_up(depth) }
end

local function check(tree)
  if tree[1] then return 1 + check(tree[1]) + check(tree[2]) end
  return 1
end

local function trees(n)
  local total = 0
  for d = 4, n, 2 do
    local iters = 1 << (n - d + 4)
    for _ = 1, iters do total = total + check(bottom_up(d)) end
  end
  return total
end

-- fannkuch: integer arrays and loops
local function fannkuch(n)
  local perm, perm1, count = {}, {}, {}
  local maxflips, checksum, r, sign = 0, 0, n, 1
  for i = 0, n - 1 do perm1[i] = i end
  while true do
    while r ~= 1 do count[r - 1] = r; r = r - 1 end
    for i = 0, n - 1 do perm[i] = perm1[i] end
    local flips = 0
    local k = perm[0]
    while k ~= 0 do
      local i, j = 0, k
      while i < j do perm[i], perm[j] = perm[j], perm[i]; i = i + 1; j = j - 1 end
      flips = flips + 1
      k = perm[0]
    end
    if flips > maxflips then maxflips = flips end
    checksum = checksum + sign * flips
    sign = -sign
    while true do
      if r == n then return checksum, maxflips end
      local p0 = perm1[0]
      for i = 0, r - 1 do perm1[i] = perm1[i + 1] end
      perm1[r] = p0
      count[r] = count[r] - 1
      if count[r] > 0 then break end
      r = r + 1
    end
  end
end

-- n-body: floating point through table fields
local function nbody(steps)
  local pi, days = math.pi, 365.24
  local sm = 4 * pi * pi
  local bodies = {
    { x = 0, y = 0, z = 0, vx = 0, vy = 0, vz = 0, mass = sm },
    { x = 4.84, y = -1.16, z = -0.10, vx = 0.606 * days, vy = 2.81 * days, vz = -0.02 * days, mass = 9.5e-4 * sm },
    { x = 8.34, y = 4.12, z = -0.40, vx = -1.01 * days, vy = 1.82 * days, vz = 0.008 * days, mass = 2.8e-4 * sm },
    { x = 12.89, y = -15.11, z = -0.22, vx = 1.08 * days, vy = 0.868 * days, vz = -0.01 * days, mass = 4.3e-5 * sm },
    { x = 15.37, y = -25.91, z = 0.17, vx = 0.979 * days, vy = 0.594 * days, vz = -0.034 * days, mass = 5.1e-5 * sm },
  }
  local n = #bodies
  for _ = 1, steps do
    for i = 1, n do
      local bi = bodies[i]
      for j = i + 1, n do
        local bj = bodies[j]
        local dx, dy, dz = bi.x - bj.x, bi.y - bj.y, bi.z - bj.z
        local d2 = dx * dx + dy * dy + dz * dz
        local mag = 0.01 / (d2 * math.sqrt(d2))
        bi.vx, bi.vy, bi.vz = bi.vx - dx * bj.mass * mag, bi.vy - dy * bj.mass * mag, bi.vz - dz * bj.mass * mag
        bj.vx, bj.vy, bj.vz = bj.vx + dx * bi.mass * mag, bj.vy + dy * bi.mass * mag, bj.vz + dz * bi.mass * mag
      end
    end
    for i = 1, n do
      local b = bodies[i]
      b.x, b.y, b.z = b.x + 0.01 * b.vx, b.y + 0.01 * b.vy, b.z + 0.01 * b.vz
    end
  end
  return bodies[1].x
end

-- objects: metatables, method calls and closures
local Account = {}
Account.__index = Account
function Account.new(balance) return setmetatable({ balance = balance, log = 0 }, Account) end
function Account:deposit(v) self.balance = self.balance + v; self.log = self.log + 1 end
function Account:withdraw(v)
  if v > self.balance then return false end
  self.balance = self.balance - v
  self.log = self.log + 1
  return true
end

local function objects(n)
  local accounts = {}
  for i = 1, 64 do accounts[i] = Account.new(i * 10) end
  local failed = 0
  local adders = {}
  for i = 1, 16 do adders[i] = function(a) a:deposit(i) end end
  for i = 1, n do
    local a = accounts[i % 64 + 1]
    adders[i % 16 + 1](a)
    if not a:withdraw(i % 37) then failed = failed + 1 end
  end
  return failed
end

-- strings: formatting, concatenation, patterns, tables of words
local function strings(n)
  local parts = {}
  for i = 1, n do parts[#parts + 1] = string.format("item%05d=%x;", i, i * 2654435761 % 4294967296) end
  local s = table.concat(parts)
  local count, sum = 0, 0
  for key, value in s:gmatch("(%a+)(%d+)=") do count = count + #key; sum = sum + tonumber(value) end
  local words = {}
  for w in s:gmatch("[%x]+;") do words[w] = (words[w] or 0) + 1 end
  local upper = s:sub(1, 2000):upper():gsub("ITEM", "x")
  return count + sum % 1000 + #upper
end

local t = trees(12 + (scale > 1 and 1 or 0))
local c, f = fannkuch(8)
local x = nbody(math.floor(40000 * scale))
local o = objects(math.floor(300000 * scale))
local s = strings(math.floor(20000 * scale))
print(string.format("trees %d fannkuch %d %d nbody %.6f objects %d strings %d", t, c, f, x, o, s))
