-- Argo CD health of a GpuPool, from the conditions the gpuslice operator writes.
-- Degraded: the pool cannot be applied (bad layout, overlapping pools, missing CheckpointPolicy)
-- or selects no node. Progressing: nodes are still applying the layout, or a busy slice blocks
-- the change until it drains. Healthy: every GPU of the pool has the layout.
local hs = {}
if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the gpuslice operator to report the pool's status"
  return hs
end
local generation = obj.metadata.generation
if generation ~= nil and obj.status.observedGeneration ~= nil and obj.status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the gpuslice operator to observe generation " .. generation
  return hs
end
local conditions = {}
for _, c in ipairs(obj.status.conditions) do
  conditions[c.type] = c
end
local function is_true(kind)
  return conditions[kind] ~= nil and conditions[kind].status == "True"
end
if is_true("Degraded") then
  hs.status = "Degraded"
  hs.message = conditions["Degraded"].message
  return hs
end
if is_true("Progressing") then
  hs.status = "Progressing"
  hs.message = conditions["Progressing"].message
  return hs
end
local ready = conditions["Ready"]
if ready == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the gpuslice operator to report the pool's status"
elseif ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message
elseif ready.reason == "NoNodes" then
  hs.status = "Degraded"
  hs.message = ready.message
else
  hs.status = "Progressing"
  hs.message = ready.message
end
return hs
