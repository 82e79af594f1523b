from django.urls import path

from speculation.gateway import views

app_name = "gateway"
urlpatterns = [
    path("chat/completions", views.chat_completions, name="chat-completions"),
    path("completions", views.completions, name="completions"),
    path("models", views.models, name="models"),
]
