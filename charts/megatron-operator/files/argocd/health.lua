-- Argo CD health check for megatron-operator.io/MegatronJob (argocd-cm key
-- resource.customizations.health.megatron-operator.io_MegatronJob; docs/gitops.md).
-- Reads only the operator's status: phase, reason, message, conditions, observedGeneration.
local hs = {}

local function condition(status, kind)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function describe(status)
  local text = status.phase
  if status.reason ~= nil and status.reason ~= "" then
    text = text .. " (" .. status.reason .. ")"
  end
  if status.message ~= nil and status.message ~= "" then
    text = text .. ": " .. status.message
  end
  return text
end

local status = obj.status
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report a status"
  return hs
end

-- A spec the operator refuses never runs: Degraded, whatever the phase says.
local invalid = condition(status, "InvalidSpec")
if status.phase == "Failed" or (invalid ~= nil and invalid.status == "True") then
  hs.status = "Degraded"
  hs.message = describe(status)
  return hs
end

if status.phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = describe(status)
  return hs
end

-- A change (suspend, activeDeadlineSeconds) the operator has not acted on yet.
local generation = obj.metadata and obj.metadata.generation
if generation ~= nil and status.observedGeneration ~= nil and status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

if status.phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = describe(status)
  return hs
end

-- Running, but no new iteration for the operator's stall timeout: GPUs held without progress.
local stalled = condition(status, "Stalled")
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = "Stalled: " .. (stalled.message or "no progress")
  return hs
end

if status.phase == "Pending" or status.phase == "Running" or status.phase == "Restarting" then
  hs.status = "Progressing"
  hs.message = describe(status)
  return hs
end

hs.status = "Unknown"
hs.message = "Unknown phase " .. tostring(status.phase)
return hs
