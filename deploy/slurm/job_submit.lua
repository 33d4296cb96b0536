-- gpuwarden's job_submit/lua hook for Slurm (tested with 22.05; Lua 5.1 with lua-socket).
--
-- Every GPU job submitted to this cluster is first put to gpuwarden's enforcer, which answers
-- admit or deny and may set the job's admin_comment and time_limit; the enforcer's watcher then
-- follows the job as lease slurm-<ClusterName>-<job id>. The hook stays thin: it sends Slurm's
-- raw fields and leaves GPU counting, GRES types, arrays and the mapping to teams and workloads
-- to gpuwarden (docs: the Slurm protocol). Jobs without a GPU request and jobs of root pass
-- without a call. A pending job whose GPU request changes (scontrol update ... Gres=) is put to
-- the enforcer again through slurm_job_modify.
--
-- Install: copy this file beside slurm.conf (Slurm loads job_submit.lua from there), set
-- JobSubmitPlugins=lua in slurm.conf, and write /etc/slurm/gpuwarden.conf (or the file named by
-- GPUWARDEN_HOOK_CONF in slurmctld's environment; see gpuwarden.conf.example). The file and the
-- token are read once when slurmctld loads this script; `scontrol reconfigure` reloads both.
--
-- Several enforcer replicas (sharing one PostgreSQL lease store) may be named in `url`, comma-
-- separated. The hook asks the one that answered last (the first at load), and moves on to the
-- next only when asking it decided nothing: no connection could be made to it, or it answered
-- 503 because its store or its view of the cluster is unavailable (store_unavailable,
-- substrate_unavailable). A replica that was reached and then fell silent or cut the connection
-- may have acted on the job, so the call fails there rather than ask another, which could admit
-- the job twice.
--
-- Failure is explicit: a call that fails (connection refused, timeout, a status other than 200,
-- an answer it cannot read) and any Lua error in this file follow `on_unavailable` (reject by
-- default), never Slurm's own rule for a failing script, which lets the job through. A rejected
-- user is told what happened and what to do, e.g. with the enforcer down:
--   sbatch: error: gpuwarden: this GPU job was not submitted: gpuwarden's admission service is
--     unreachable at http://127.0.0.1:8080 (connection refused). Try again in a few minutes; if
--     it keeps failing, contact your cluster administrator.
--   sbatch: error: Batch job submission failed: Requested operation is presently disabled
--
-- Each decision is one line in slurmctld's log, with the call's latency in milliseconds and the
-- enforcer that answered (or the last one tried):
--   gpuwarden: submit decision=admit reason=answer user=alice uid=1001 latency_ms=1.07
--     url=http://127.0.0.1:8080
-- (bench/slurm.sh reads latency_ms from these lines); moving on from an enforcer is a line too.

local socket = require("socket")

local CONF_PATH = os.getenv("GPUWARDEN_HOOK_CONF") or "/etc/slurm/gpuwarden.conf"

-- Values Slurm uses for "not set" and "unlimited"; such numbers are sent as null.
local UNSET_NUMBERS = {
   [4294967294] = true, [4294967295] = true, -- NO_VAL, INFINITE
   [65534] = true, [65535] = true,           -- NO_VAL16, INFINITE16
}
for _, name in ipairs({ "NO_VAL", "NO_VAL16", "NO_VAL64", "INFINITE", "INFINITE16", "INFINITE64" }) do
   if slurm[name] ~= nil then UNSET_NUMBERS[slurm[name]] = true end
end

-- What a denial returns: sbatch prints the message given with log_user, then "Batch job
-- submission failed: Access/permission denied". scontrol update (22.05) prints only the latter,
-- the message stays in slurmctld's log.
local DENIED = slurm.ESLURM_ACCESS_DENIED or slurm.ERROR

-- What a job gets when gpuwarden could not decide on it (and on_unavailable is reject): sbatch
-- prints the message given with log_user, then "Batch job submission failed: Requested
-- operation is presently disabled" (ESLURM_DISABLED, 2037 in every Slurm since 2.x; the Lua
-- plugin does not export it). Not slurm.ERROR, which sbatch shows as "Unspecified error"; and
-- none of the codes sbatch retries by itself (EAGAIN, ESLURM_ERROR_ON_DESC_TO_RECORD_COPY,
-- ESLURM_NODES_BUSY), which would hold the user's sbatch for minutes, asking again each time.
local UNAVAILABLE = slurm.ESLURM_DISABLED or 2037

local TRES_FIELDS = { "tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket" }
local SHAPE_FIELDS = { "min_nodes", "max_nodes", "num_tasks", "ntasks_per_node",
   "sockets_per_node", "array_inx" }

---------------------------------------------------------------------------------------------------
-- Configuration, read once at load.

local function trim(s)
   return (string.gsub(s, "^%s*(.-)%s*$", "%1"))
end

-- Returns the configuration table, or nil and a sentence saying what is wrong.
local function read_conf(path)
   local file, err = io.open(path, "r")
   if file == nil then return nil, "cannot read " .. path .. ": " .. tostring(err) end
   local conf = { timeout = 0.5, on_unavailable = "reject" }
   local n = 0
   for line in file:lines() do
      n = n + 1
      line = trim(string.gsub(line, "#.*$", ""))
      if line ~= "" then
         local key, value = string.match(line, "^([%w_]+)%s*=%s*(.-)$")
         if key == nil then
            file:close()
            return nil, string.format("%s line %d: expected `key = value`", path, n)
         end
         conf[key] = value
      end
   end
   file:close()
   for _, key in ipairs({ "url", "substrate", "token_file" }) do
      if conf[key] == nil or conf[key] == "" then
         return nil, string.format("%s: `%s` is required", path, key)
      end
   end
   -- One enforcer, or several replicas: URLs separated by commas.
   conf.targets = {}
   for item in string.gmatch(conf.url, "[^,]+") do
      local url = string.gsub(trim(item), "/+$", "")
      if url ~= "" then
         local host, port, prefix = string.match(url, "^http://([^/:]+):?(%d*)(.*)$")
         if host == nil or (prefix ~= "" and string.sub(prefix, 1, 1) ~= "/") then
            return nil, string.format("%s: `url` must be http://host[:port][/path] (several "
               .. "separated by commas), not %s", path, url)
         end
         table.insert(conf.targets,
            { url = url, host = host, port = tonumber(port) or 80, prefix = prefix })
      end
   end
   if #conf.targets == 0 then return nil, path .. ": `url` names no enforcer" end
   local urls = {}
   for i, target in ipairs(conf.targets) do urls[i] = target.url end
   conf.url = table.concat(urls, ",")
   conf.timeout = tonumber(conf.timeout)
   if conf.timeout == nil or conf.timeout <= 0 then
      return nil, path .. ": `timeout` must be a positive number of seconds"
   end
   if conf.on_unavailable ~= "reject" and conf.on_unavailable ~= "admit" then
      return nil, path .. ": `on_unavailable` must be reject or admit"
   end
   local token_file, terr = io.open(conf.token_file, "r")
   if token_file == nil then
      return nil, "cannot read token_file " .. conf.token_file .. ": " .. tostring(terr)
   end
   conf.token = trim(token_file:read("*a") or "")
   token_file:close()
   if conf.token == "" then return nil, "token_file " .. conf.token_file .. " is empty" end
   conf.submit_path = "/v1/slurm/" .. conf.substrate .. "/submit"
   conf.modify_path = "/v1/slurm/" .. conf.substrate .. "/modify"
   return conf
end

-- Without a readable configuration every GPU job is rejected: nothing says admitting is wanted.
local CONF, CONF_ERROR = read_conf(CONF_PATH)
if CONF == nil then
   slurm.log_error("gpuwarden: %s; GPU jobs are rejected until it is fixed (scontrol reconfigure)",
      CONF_ERROR)
end

---------------------------------------------------------------------------------------------------
-- JSON encoding of the request.

local ESCAPES = { ['"'] = '\\"', ['\\'] = '\\\\', ['\b'] = '\\b', ['\f'] = '\\f',
   ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t' }

local function json_string(s)
   return '"' .. string.gsub(s, '[%c"\\]', function(c)
      return ESCAPES[c] or string.format("\\u%04x", string.byte(c))
   end) .. '"'
end

local function json_value(v)
   local t = type(v)
   if t == "string" then return json_string(v) end
   if t == "number" then
      if v ~= v or v == math.huge or v == -math.huge or UNSET_NUMBERS[v] then return "null" end
      if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return string.format("%d", v) end
      return string.format("%.17g", v)
   end
   if t == "boolean" then return tostring(v) end
   return "null"
end

-- `fields` is a list of {name, value} pairs, so that the body keeps the protocol's order.
local function json_object(fields)
   local parts = {}
   for i, kv in ipairs(fields) do
      parts[i] = json_string(kv[1]) .. ":" .. json_value(kv[2])
   end
   return "{" .. table.concat(parts, ",") .. "}"
end

---------------------------------------------------------------------------------------------------
-- The call and its answer.

-- Reads the answer's lines; returns {decision=, admin_comment=, time_limit=, message=} or nil and
-- what is wrong with it.
local function parse_answer(body)
   local answer = nil
   for line in string.gmatch(body, "[^\n]+") do
      line = string.gsub(line, "\r$", "")
      if answer == nil then
         line = trim(line)
         if line ~= "admit" and line ~= "deny" then
            return nil, "the answer's first line is neither admit nor deny"
         end
         answer = { decision = line }
      else
         local key, value = string.match(line, "^([%w_]+)=(.*)$")
         if key == "admin_comment" or key == "message" then
            answer[key] = value
         elseif key == "time_limit" then
            answer.time_limit = tonumber(value)
            if answer.time_limit == nil then return nil, "time_limit is not a number" end
         end -- other keys are for later versions of the protocol
      end
   end
   if answer == nil then return nil, "the answer is empty" end
   return answer
end

local function one_line(s)
   return (string.gsub(tostring(s), "[%c]", " "))
end

-- One connection to an enforcer, kept from call to call (HTTP/1.1 keep-alive): a call then
-- costs no TCP handshake, and the enforcer no accept and no wake-up for it. CONN_AT is the index
-- in CONF.targets of the enforcer it goes to.
local CONN, CONN_AT = nil, nil

-- The enforcer asked first: the one that answered last. While a replica is down, calls go to
-- another without trying the dead one first (which costs up to `timeout` when nothing refuses
-- the connection).
local PREFERRED = 1

local function drop_connection()
   if CONN ~= nil then CONN:close() end
   CONN, CONN_AT = nil, nil
end

-- Sends `request` on `sock` and reads the answer: status, body and whether the enforcer closes
-- the connection after it; or nil, why, and whether nothing at all came back (the connection was
-- closed before any answer, so the enforcer never saw the request).
local function exchange(sock, request)
   local sent, err = sock:send(request)
   if sent == nil then return nil, err, err == "closed" end
   local status_line
   status_line, err = sock:receive("*l")
   if status_line == nil then return nil, err, err == "closed" end
   local status = tonumber(string.match(status_line, "^HTTP/1%.%d (%d%d%d)"))
   if status == nil then return nil, "not an HTTP answer: " .. status_line end
   local length, close = nil, false
   while true do
      local line
      line, err = sock:receive("*l")
      if line == nil then return nil, err end
      if line == "" then break end
      local name, value = string.match(line, "^([^:]+):%s*(.-)%s*$")
      if name ~= nil then
         name = string.lower(name)
         if name == "content-length" then length = tonumber(value) end
         if name == "connection" and string.lower(value) == "close" then close = true end
      end
   end
   if length == nil then return nil, "the answer has no content-length" end
   local body = ""
   if length > 0 then
      body, err = sock:receive(length)
      if body == nil then return nil, err end
   end
   return status, body, close
end

-- The error codes of a 503 that decided nothing, which another replica may answer: its lease
-- store's database cannot be reached, or it has not read this cluster yet.
local MOVE_ON_CODES = { store_unavailable = true, substrate_unavailable = true }

-- POSTs `body` to `path` on enforcer `at` (an index in CONF.targets). Returns the parsed answer;
-- or nil, why the call failed, how the enforcer failed to answer: "unreachable" (no connection
-- could be made: refused, no route, a connect timeout), "no_answer" (it was reached, but the call
-- timed out or the connection was cut before a whole answer came), or nil (it answered, with an
-- error or something unreadable); and whether it decided nothing, so another may be asked.
local function call_one(at, path, body)
   local target = CONF.targets[at]
   local request = "POST " .. target.prefix .. path .. " HTTP/1.1\r\n"
      .. "Host: " .. target.host .. ":" .. target.port .. "\r\n"
      .. "Authorization: Bearer " .. CONF.token .. "\r\n"
      .. "Content-Type: application/json\r\n"
      .. "Content-Length: " .. #body .. "\r\n\r\n" .. body
   if CONN ~= nil and CONN_AT ~= at then drop_connection() end
   local status, answer, close
   for _ = 1, 2 do
      local kept = CONN ~= nil
      if not kept then
         local sock = socket.tcp()
         sock:settimeout(CONF.timeout)
         local ok, err = sock:connect(target.host, target.port)
         if ok == nil then
            sock:close()
            return nil, tostring(err), "unreachable", true
         end
         sock:setoption("tcp-nodelay", true)
         CONN, CONN_AT = sock, at
      end
      local unseen
      status, answer, unseen = exchange(CONN, request)
      if status ~= nil then
         close = unseen -- after an answer, exchange's third value says the enforcer closes
         break
      end
      drop_connection()
      -- A kept connection the enforcer had closed meanwhile: the request never reached it, so
      -- it is sent again once on a new one (and when that cannot be made, to the next
      -- enforcer). Anything else (a timeout) is a failed call: the enforcer may have acted on it,
      -- and asking twice, here or elsewhere, could admit twice.
      if not (kept and unseen) then return nil, tostring(answer), "no_answer", false end
   end
   if status == nil then return nil, tostring(answer), "no_answer", false end
   if close then drop_connection() end
   -- 400 or 422: gpuwarden could not read this job's fields (a name that is not UTF-8, a number
   -- out of range). That is the job's fault, not an outage: it is denied, whatever
   -- on_unavailable says.
   if status == 400 or status == 422 then
      return { decision = "deny", message = "gpuwarden cannot read this job's request: "
         .. string.sub(answer, 1, 300) }
   end
   if status == 503 then
      -- The API's error shape, {"error": {"code": …}}, read without a JSON library.
      local code = string.match(answer, '"code"%s*:%s*"([%w_]+)"')
      if code ~= nil then
         return nil, "HTTP status 503: " .. code, nil, MOVE_ON_CODES[code] == true
      end
   end
   if status ~= 200 then return nil, "HTTP status " .. tostring(status), nil, false end
   local parsed, err = parse_answer(answer)
   return parsed, err, nil, false
end

-- Asks the enforcers in turn, from the preferred one, moving on only from one that decided
-- nothing. Returns the answer, or nil; the failed attempts, in order ({url=, failure=,
-- unanswered=} each); and the URL of the enforcer that answered, or was asked last.
local function call(path, body)
   local n = #CONF.targets
   local first = PREFERRED
   local failures = {}
   for i = 0, n - 1 do
      local at = (first - 1 + i) % n + 1
      local url = CONF.targets[at].url
      local answer, failure, unanswered, move_on = call_one(at, path, body)
      if answer ~= nil then
         PREFERRED = at
         return answer, failures, url
      end
      table.insert(failures, { url = url, failure = failure, unanswered = unanswered })
      if not move_on or i == n - 1 then return nil, failures, url end
      slurm.log_info("gpuwarden: enforcer %s decided nothing (%s); asking %s", url,
         one_line(failure), CONF.targets[at % n + 1].url)
   end
end

local function elapsed_ms(started)
   return string.format("%.2f", (socket.gettime() - started) * 1000)
end

-- What went wrong with one enforcer, after "gpuwarden's admission service".
local function attempt_clause(attempt)
   if attempt.unanswered == "unreachable" then
      return string.format("is unreachable at %s (%s)", attempt.url, one_line(attempt.failure))
   elseif attempt.unanswered == "no_answer" then
      -- It was reached: not "unreachable", which sends an administrator to the network.
      return string.format("at %s did not answer in time (%s)", attempt.url,
         attempt.failure == "timeout" and "timeout"
            or "the connection was cut: " .. one_line(attempt.failure))
   end
   return string.format("at %s could not decide on it (%s)", attempt.url,
      one_line(attempt.failure))
end

-- What the user is told when gpuwarden could not decide on the job: what did not happen, why,
-- and what to do. `what` is "submit" or "modify"; `failures` the enforcers asked and what went
-- wrong with each (see `call`); `hook_failed` a Lua error in this file.
local function unavailable_message(what, failures, hook_failed)
   local outcome = what == "modify" and "this change to the job was not made"
      or "this GPU job was not submitted"
   if CONF == nil or hook_failed then
      return string.format("gpuwarden: %s: gpuwarden's Slurm hook %s. Contact your cluster "
         .. "administrator (slurmctld's log says what is wrong).", outcome,
         hook_failed and "failed on it" or "is not configured correctly on this cluster")
   end
   local clauses = {}
   for i, attempt in ipairs(failures) do clauses[i] = attempt_clause(attempt) end
   return string.format("gpuwarden: %s: gpuwarden's admission service %s. Try again in a few "
      .. "minutes; if it keeps failing, contact your cluster administrator.", outcome,
      table.concat(clauses, ", and "))
end

-- The failures for the log: the one failure, or each enforcer's.
local function failures_text(failures)
   if #failures == 1 then return one_line(failures[1].failure) end
   local parts = {}
   for i, attempt in ipairs(failures) do
      parts[i] = attempt.url .. ": " .. one_line(attempt.failure)
   end
   return table.concat(parts, "; ")
end

-- Applies the answer to the job (or the failure to it); returns slurm.SUCCESS, DENIED or
-- UNAVAILABLE. `what` is "submit" or "modify", `who` a few words naming the job for the log line,
-- `url` the enforcer that answered (or was asked last; nil when none was).
local function decide(what, who, job_desc, answer, failures, url, hook_failed, started)
   local latency = elapsed_ms(started)
   local at = url ~= nil and " url=" .. url or ""
   if answer == nil then
      local admit = CONF ~= nil and CONF.on_unavailable == "admit"
      local decision = admit and "admit" or "reject"
      slurm.log_error("gpuwarden: %s decision=%s reason=unavailable %s latency_ms=%s%s error=%s",
         what, decision, who, latency, at, failures_text(failures))
      if admit then return slurm.SUCCESS end
      slurm.log_user("%s", unavailable_message(what, failures, hook_failed))
      return UNAVAILABLE
   end
   if answer.decision == "deny" then
      slurm.log_info("gpuwarden: %s decision=deny reason=answer %s latency_ms=%s%s message=%s",
         what, who, latency, at, one_line(answer.message or ""))
      slurm.log_user("%s", answer.message or "gpuwarden denied this GPU request")
      return DENIED
   end
   if answer.admin_comment ~= nil then job_desc.admin_comment = answer.admin_comment end
   if answer.time_limit ~= nil then job_desc.time_limit = answer.time_limit end
   slurm.log_info("gpuwarden: %s decision=admit reason=answer %s latency_ms=%s%s", what, who,
      latency, at)
   if answer.message ~= nil and answer.message ~= "" then slurm.log_user("%s", answer.message) end
   return slurm.SUCCESS
end

-- Runs `body_fn` (which builds the request) and the call under pcall, so that an error anywhere
-- is a failed call and follows on_unavailable.
local function guarded(what, who, job_desc, path_field, body_fn)
   local started = socket.gettime()
   local ok, answer, failures, url = pcall(function()
      if CONF == nil then return nil, { { failure = CONF_ERROR } } end
      return call(CONF[path_field], body_fn())
   end)
   local hook_failed = not ok
   if hook_failed then
      answer, failures, url = nil, { { failure = "Lua error: " .. tostring(answer) } }, nil
   end
   return decide(what, who, job_desc, answer, failures, url, hook_failed, started)
end

local function asks_gpu(tres)
   return tres ~= nil and string.find(tres, "gpu", 1, true) ~= nil
end

---------------------------------------------------------------------------------------------------
-- Slurm's entry points.

local function submit(job_desc, submit_uid)
   local gpu = false
   for _, field in ipairs(TRES_FIELDS) do
      if asks_gpu(job_desc[field]) then gpu = true end
   end
   if not gpu or submit_uid == 0 then return slurm.SUCCESS end
   local who = string.format("user=%s uid=%s", tostring(job_desc.user_name), tostring(submit_uid))
   return guarded("submit", who, job_desc, "submit_path", function()
      -- Only a batch job (one with a script) has an environment Slurm lets the hook read.
      local lease_id = nil
      if job_desc.script ~= nil then
         local env = job_desc.environment
         if env ~= nil then lease_id = env.GPUWARDEN_LEASE_ID end
      end
      return json_object({
         { "user", job_desc.user_name },
         { "uid", submit_uid },
         { "account", job_desc.account },
         { "partition", job_desc.partition },
         { "qos", job_desc.qos },
         { "comment", job_desc.comment },
         { "wckey", job_desc.wckey },
         { "job_name", job_desc.name },
         { "tres_per_node", job_desc.tres_per_node },
         { "tres_per_job", job_desc.tres_per_job },
         { "tres_per_task", job_desc.tres_per_task },
         { "tres_per_socket", job_desc.tres_per_socket },
         { "min_nodes", job_desc.min_nodes },
         { "max_nodes", job_desc.max_nodes },
         { "num_tasks", job_desc.num_tasks },
         { "ntasks_per_node", job_desc.ntasks_per_node },
         { "sockets_per_node", job_desc.sockets_per_node },
         { "array_inx", job_desc.array_inx },
         { "time_limit", job_desc.time_limit },
         { "lease_id", lease_id },
      })
   end)
end

local function modify(job_desc, job_rec, modify_uid)
   -- Whatever changes how many GPUs the job holds: its GPU requests, its nodes and tasks, and
   -- an array's index or throttle.
   local changed = false
   for _, field in ipairs(TRES_FIELDS) do
      local new = job_desc[field]
      if new ~= nil and new ~= job_rec[field] then changed = true end
   end
   for _, field in ipairs(SHAPE_FIELDS) do
      local new = job_desc[field]
      if new ~= nil and not UNSET_NUMBERS[new] and new ~= job_rec[field] then changed = true end
   end
   -- A job of root was admitted without a call; its changes are not gpuwarden's to judge.
   if not changed or job_rec.user_id == 0 then return slurm.SUCCESS end
   local who = string.format("job=%s uid=%s by_uid=%s", tostring(job_rec.job_id),
      tostring(job_rec.user_id), tostring(modify_uid))
   return guarded("modify", who, job_desc, "modify_path", function()
      local function new_or_old(field)
         local v = job_desc[field]
         if v == nil or UNSET_NUMBERS[v] then v = job_rec[field] end
         return v
      end
      return json_object({
         { "job_id", job_rec.job_id },
         { "user", job_rec.user_name },
         { "uid", job_rec.user_id },
         { "admin_comment", job_rec.admin_comment },
         { "tres_per_node", new_or_old("tres_per_node") },
         { "tres_per_job", new_or_old("tres_per_job") },
         { "tres_per_task", new_or_old("tres_per_task") },
         { "tres_per_socket", new_or_old("tres_per_socket") },
         { "min_nodes", new_or_old("min_nodes") },
         { "max_nodes", new_or_old("max_nodes") },
         { "num_tasks", new_or_old("num_tasks") },
         { "ntasks_per_node", new_or_old("ntasks_per_node") },
         { "sockets_per_node", new_or_old("sockets_per_node") },
         { "array_inx", job_desc.array_inx },
      })
   end)
end

-- A Lua error escaping to Slurm would let the job through: everything runs under pcall, and an
-- error outside the call follows on_unavailable too.
local function failed(what, err)
   slurm.log_error("gpuwarden: %s Lua error: %s", what, one_line(err))
   if CONF ~= nil and CONF.on_unavailable == "admit" then return slurm.SUCCESS end
   slurm.log_user("%s", unavailable_message(what, { { failure = err } }, true))
   return UNAVAILABLE
end

function slurm_job_submit(job_desc, part_list, submit_uid)
   local ok, result = pcall(submit, job_desc, submit_uid)
   if ok then return result end
   return failed("submit", result)
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
   local ok, result = pcall(modify, job_desc, job_rec, modify_uid)
   if ok then return result end
   return failed("modify", result)
end

if CONF ~= nil then
   slurm.log_info("gpuwarden: hook loaded from %s: substrate=%s url=%s timeout=%ss on_unavailable=%s",
      CONF_PATH, CONF.substrate, CONF.url, tostring(CONF.timeout), CONF.on_unavailable)
end
return slurm.SUCCESS
