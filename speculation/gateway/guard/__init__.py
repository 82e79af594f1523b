"""The goodput guard's parts: pure rules (`rules`), the sample store (`samples`), in-flight counting (`load`), host
topology (`topology`) and the cost model read from measurements (`costs`); speculation.gateway.goodput joins them."""
