-- Argo CD health check for posttrain.dev/PostTrainJob.
-- Argo CD runs this with `obj` set to the live resource and reads hs.status/hs.message.
--   Succeeded -> Healthy, Failed -> Degraded, Suspended -> Suspended,
--   Pending/Queued/Running/Restarting -> Progressing (status.message, plus step/total),
--   no status yet -> Progressing "Waiting for the operator".
local hs = {}
local status = obj.status
if status == nil or status.phase == nil or status.phase == "" then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator"
  return hs
end

local phase = status.phase
local message = status.message
if message == nil or message == "" then
  message = phase
end

local progress = status.progress
if progress ~= nil and progress.step ~= nil and progress.totalSteps ~= nil then
  message = string.format("%s (step %d/%d)", message, math.floor(progress.step),
    math.floor(progress.totalSteps))
end

if phase == "Succeeded" then
  hs.status = "Healthy"
elseif phase == "Failed" then
  hs.status = "Degraded"
elseif phase == "Suspended" then
  hs.status = "Suspended"
elseif phase == "Pending" or phase == "Queued" or phase == "Running" or phase == "Restarting" then
  hs.status = "Progressing"
else
  hs.status = "Unknown"
  message = "unknown phase " .. phase
end
hs.message = message
return hs
